"""`sglang.grpc.scheduler` messages <-> the request structs and result dicts of the front.

Pure functions with no I/O, for `SglangSchedulerServicer`. A GenerateRequest becomes the
same `GenerateReqInput` the HTTP /generate route builds from token ids, so every check
(sampling ranges, token ids, context length, logprob sizes) runs once, in the front.

The wire is proto3 without presence for most sampling scalars: a client that leaves
top_p, top_k, repetition_penalty or n unset sends 0, which no request means (it would
keep no token, or divide by zero), so 0 reads as "not set". SGLang's gateway always sends
explicit values (temperature 1.0 by default, 0 for greedy).
"""

from __future__ import annotations

from typing import Any

from cadence.errors import InvalidParameter
from cadence.front.engine_client import ModelInfo
from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc.convert import disaggregated_fields
from cadence.io_struct import EmbeddingReqInput, GenerateReqInput

# proto3 zero -> the neutral value it stands for
_ZERO_MEANS_UNSET = {"top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty")
_CONSTRAINTS = ("regex", "json_schema", "ebnf_grammar", "structural_tag")


def _decimal(value: float) -> float:
    """A float32 from the wire as the decimal the client wrote (0.7, not 0.699999988)."""
    return float(f"{value:.7g}")


def sampling_params(msg: pb.SamplingParams) -> dict[str, Any]:
    """The sampling_params dict of /generate. Constrained decoding is refused here (the
    front does not serve it yet, and has no structural_tag at all)."""
    constraint = msg.WhichOneof("constraint")
    if constraint is not None:
        raise InvalidParameter(
            f"sampling_params.{constraint}",
            f"sampling_params.{constraint}: constrained decoding is not supported by this "
            "server yet; remove the constraint",
        )
    params: dict[str, Any] = {name: _decimal(getattr(msg, name)) for name in _FLOATS}
    params["top_k"] = msg.top_k
    params["repetition_penalty"] = _decimal(msg.repetition_penalty)
    for name, neutral in _ZERO_MEANS_UNSET.items():
        if params[name] == 0:
            params[name] = neutral
    if msg.HasField("max_new_tokens"):
        params["max_new_tokens"] = msg.max_new_tokens
    params.update(
        min_new_tokens=msg.min_new_tokens,
        n=msg.n or 1,
        ignore_eos=msg.ignore_eos,
        no_stop_trim=msg.no_stop_trim,
        skip_special_tokens=msg.skip_special_tokens,
        spaces_between_special_tokens=msg.spaces_between_special_tokens,
    )
    if msg.stop:
        params["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        params["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        params["logit_bias"] = {k: _decimal(v) for k, v in msg.logit_bias.items()}
    # stream_interval (a delivery cadence) and custom_params (arguments for a custom logit
    # processor, which is refused) change nothing here: they are accepted and ignored.
    return params


def generate_input(req: pb.GenerateRequest, info: ModelInfo, rid: str) -> GenerateReqInput:
    """The GenerateReqInput of a Generate call with request id `rid` (not yet normalized).
    Fields this server cannot honour are refused, naming the field; the front checks the
    rest. With n > 1 the front gives sample j the rid f"{rid}-{j}". `lora_id` is left to
    the servicer, which resolves it against the loaded adapters."""
    _refuse_unserved(req)
    input_ids = list(req.tokenized.input_ids)
    if not input_ids:
        raise InvalidParameter(
            "tokenized.input_ids", "tokenized.input_ids is required: the prompt's token ids"
        )
    params = sampling_params(req.sampling_params)
    if "max_new_tokens" not in params:
        # Absent: whatever the context (and the KV pool) leaves, as SGLang's scheduler does.
        room = min(info.context_len, info.max_total_tokens) - len(input_ids)
        params["max_new_tokens"] = max(room, 1)
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids,
        sampling_params=params,
        rid=rid,
        stream=req.stream,
        **disaggregated_fields(req),
    )
    if req.return_logprob:
        if req.top_logprobs_num < 0:
            raise InvalidParameter(
                "top_logprobs_num", f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}"
            )
        if req.logprob_start_len < -1:
            raise InvalidParameter(
                "logprob_start_len",
                f"logprob_start_len must be -1 (output logprobs only) or a prompt position, "
                f"got {req.logprob_start_len}",
            )
        kwargs.update(
            return_logprob=True,
            top_logprobs_num=req.top_logprobs_num,
            logprob_start_len=req.logprob_start_len,
        )
        if req.token_ids_logprob:
            kwargs["token_ids_logprob"] = list(req.token_ids_logprob)
    return GenerateReqInput(**kwargs)


def _refuse_unserved(req: pb.GenerateRequest) -> None:
    refusals = [
        (req.return_hidden_states, "return_hidden_states", "this server returns no hidden states"),
        (
            bool(req.custom_logit_processor),
            "custom_logit_processor",
            "this server runs no custom logit processor",
        ),
        (
            len(req.input_embeds) > 0,
            "input_embeds",
            "this server takes token ids only (tokenized.input_ids)",
        ),
        (
            req.HasField("mm_inputs") and req.mm_inputs.ByteSize() > 0,
            "mm_inputs",
            "this model takes no multimodal input",
        ),
        (
            req.HasField("data_parallel_rank") and req.data_parallel_rank != 0,
            "data_parallel_rank",
            f"this server has one data-parallel rank (0), got {req.data_parallel_rank}",
        ),
    ]
    for is_set, field, why in refusals:
        if is_set:
            raise InvalidParameter(field, f"{field}: {why}; leave the field unset")


# ---- results -> messages ------------------------------------------------------------------

_OUTPUT_FIELDS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
_INPUT_FIELDS = ("input_token_logprobs", "input_top_logprobs")


def is_finished(result: dict) -> bool:
    return result["meta_info"].get("finish_reason") is not None


def _rows(rows) -> list[pb.TopLogProbs]:
    """Per-position alternatives ([logprob, id, text] entries per row), or [] when no row
    has any (the request did not ask for them: every row is None)."""
    if not rows or all(row is None for row in rows):
        return []
    return [
        pb.TopLogProbs(values=[e[0] for e in row or ()], token_ids=[e[1] for e in row or ()])
        for row in rows
    ]


def output_logprobs(meta: dict) -> pb.OutputLogProbs | None:
    """The output logprobs in `meta` (None when the request did not ask for them)."""
    tokens = meta.get("output_token_logprobs")
    if tokens is None:
        return None
    return pb.OutputLogProbs(
        token_logprobs=[e[0] for e in tokens],
        token_ids=[e[1] for e in tokens],
        top_logprobs=_rows(meta.get("output_top_logprobs")),
        token_ids_logprobs=_rows(meta.get("output_token_ids_logprobs")),
    )


def input_logprobs(meta: dict) -> pb.InputLogProbs | None:
    """The prompt logprobs in `meta` (None when there are none: not asked for, or already
    sent); the first prompt token has no value."""
    tokens = meta.get("input_token_logprobs")
    if not tokens:
        return None
    return pb.InputLogProbs(
        token_logprobs=[
            pb.InputTokenLogProb() if e[0] is None else pb.InputTokenLogProb(value=e[0])
            for e in tokens
        ],
        token_ids=[e[1] for e in tokens],
        top_logprobs=_rows(meta.get("input_top_logprobs")),
    )


def chunk_response(request_id: str, chunk: dict, index: int) -> pb.GenerateResponse | None:
    """A streamed delta as a GenerateStreamChunk: its new token ids and logprobs, the
    totals so far. None when the delta carries nothing new (a bare finish)."""
    meta = chunk["meta_info"]
    out_lp = output_logprobs(meta)
    in_lp = input_logprobs(meta)
    if not chunk["output_ids"] and in_lp is None and (out_lp is None or not out_lp.token_ids):
        return None
    return pb.GenerateResponse(
        request_id=request_id,
        chunk=pb.GenerateStreamChunk(
            token_ids=chunk["output_ids"],
            prompt_tokens=meta.get("prompt_tokens", 0),
            completion_tokens=meta.get("completion_tokens", 0),
            cached_tokens=meta.get("cached_tokens", 0),
            output_logprobs=out_lp,
            input_logprobs=in_lp,
            index=index,
        ),
    )


def finish(reason: dict | None) -> tuple[str, dict[str, Any]]:
    """The OpenAI finish reason ("stop", "length", "abort") and the matched_stop field."""
    kind = reason.get("type") if reason else None
    if kind in ("length", "abort"):
        return kind, {}
    matched = reason.get("matched") if reason else None
    if isinstance(matched, str):
        return "stop", {"matched_stop_str": matched}
    if isinstance(matched, int):
        return "stop", {"matched_token_id": matched}
    return "stop", {}


def complete_response(request_id: str, result: dict, index: int) -> pb.GenerateResponse:
    """A sample's end as a GenerateComplete: every output id, cumulative logprobs, why it
    ended. `result` is a final (non-streamed) result or a stream's `Totals.result()`."""
    meta = result["meta_info"]
    reason, matched = finish(meta.get("finish_reason"))
    return pb.GenerateResponse(
        request_id=request_id,
        complete=pb.GenerateComplete(
            output_ids=result["output_ids"],
            finish_reason=reason,
            prompt_tokens=meta.get("prompt_tokens", 0),
            completion_tokens=meta.get("completion_tokens", len(result["output_ids"])),
            cached_tokens=meta.get("cached_tokens", 0),
            output_logprobs=output_logprobs(meta),
            input_logprobs=input_logprobs(meta),
            index=index,
            spec_accepted_tokens=meta.get("spec_accepted_tokens", 0),
            spec_draft_tokens=meta.get("spec_num_proposed_drafts", 0),
            **matched,
        ),
    )


class Totals:
    """What one sample of a streamed request produced so far (its deltas added up), for
    the GenerateComplete that ends it."""

    __slots__ = ("output_ids", "logprobs", "meta")

    def __init__(self):
        self.output_ids: list[int] = []
        self.logprobs: dict[str, list] = {}
        self.meta: dict[str, Any] = {}

    def add(self, chunk: dict) -> None:
        self.output_ids.extend(chunk["output_ids"])
        meta = chunk["meta_info"]
        for name in (*_OUTPUT_FIELDS, *_INPUT_FIELDS):
            values = meta.get(name)
            if values is not None:
                self.logprobs.setdefault(name, []).extend(values)
        self.meta = meta

    def result(self) -> dict:
        return {"output_ids": self.output_ids, "meta_info": {**self.meta, **self.logprobs}}


def embed_input(req: pb.EmbedRequest, rid: str) -> EmbeddingReqInput:
    """The EmbeddingReqInput of an Embed call (SMG tokenized the input, the pair of a
    cross-encoder included: its segments come as token_type_ids)."""
    input_ids = list(req.tokenized.input_ids)
    if not input_ids:
        raise InvalidParameter(
            "tokenized.input_ids", "tokenized.input_ids is required: the input's token ids"
        )
    if req.HasField("mm_inputs") and req.mm_inputs.ByteSize() > 0:
        raise InvalidParameter("mm_inputs", "mm_inputs: this model takes no multimodal input")
    if req.data_parallel_rank != 0:
        raise InvalidParameter(
            "data_parallel_rank",
            f"data_parallel_rank: this server has one data-parallel rank (0), got "
            f"{req.data_parallel_rank}",
        )
    types = list(req.token_type_ids) or None
    return EmbeddingReqInput(input_ids=input_ids, token_type_ids=types, rid=rid)
