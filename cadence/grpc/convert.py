"""Protobuf messages <-> the request structs and result dicts of the TokenizerManager.

Pure functions with no I/O. Requests become the same `GenerateReqInput` the HTTP /generate
route builds, so every check (sampling ranges, token ids, context length) runs once,
below both adapters. Only fields the client set reach it (proto3 `optional` presence), so
the defaults are the native API's own.
"""

from __future__ import annotations

from typing import Any

import msgspec

from cadence.errors import InvalidParameter
from cadence.grpc import sglang_pb2 as pb
from cadence.io_struct import GenerateReqInput

_SAMPLING_SCALARS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "max_new_tokens",
    "min_new_tokens",
    "ignore_eos",
    "n",
    "json_schema",
    "regex",
    "ebnf",  # Cadence's own field (100)
)
_FLOAT_FIELDS = frozenset(
    ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
)
# Request fields copied as they are when present (same name on both sides).
_REQUEST_SCALARS = (
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "rid",
    "lora_path",
    "routing_key",
)

_json = msgspec.json.Encoder()


def sampling_params(msg: pb.SamplingParams) -> dict[str, Any]:
    """The sampling_params dict of /generate, holding only what the client set."""
    params: dict[str, Any] = {}
    for name in _SAMPLING_SCALARS:
        if msg.HasField(name):
            value = getattr(msg, name)
            # float32 on the wire: 0.95 arrives as 0.949999988; give back the decimal sent.
            params[name] = float(f"{value:.7g}") if name in _FLOAT_FIELDS else value
    if msg.stop:
        params["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        params["stop_token_ids"] = list(msg.stop_token_ids)
    return params


def disaggregated_fields(req: Any) -> dict[str, Any]:
    """`disaggregated_params` (both services) as the native bootstrap fields; the front
    requires them on a prefill or decode server and ignores them on one that runs both."""
    if not req.HasField("disaggregated_params"):
        return {}
    d = req.disaggregated_params
    return {
        "bootstrap_host": d.bootstrap_host,
        "bootstrap_port": d.bootstrap_port,
        "bootstrap_room": d.bootstrap_room,
    }


def generate_input(req: pb.TextGenerateRequest | pb.GenerateRequest) -> GenerateReqInput:
    """The GenerateReqInput of a TextGenerate or Generate call (not yet normalized)."""
    if req.HasField("routed_dp_rank") and req.routed_dp_rank != 0:
        raise InvalidParameter(
            "routed_dp_rank",
            f"routed_dp_rank: this server has one data-parallel rank (0), got {req.routed_dp_rank}",
        )
    kwargs: dict[str, Any] = {"stream": req.stream, **disaggregated_fields(req)}
    if isinstance(req, pb.TextGenerateRequest):
        kwargs["text"] = req.text
        kwargs["return_text_in_logprobs"] = req.return_text_in_logprobs
    else:
        kwargs["input_ids"] = list(req.input_ids)
    if req.HasField("sampling_params"):
        kwargs["sampling_params"] = sampling_params(req.sampling_params)
    for name in _REQUEST_SCALARS:
        if req.HasField(name):
            kwargs[name] = getattr(req, name)
    if req.HasField("session_id"):
        # A request of an open session (`/open_session`): in a streaming session it continues
        # the latest request; otherwise it starts a new line of the session (SGLang's
        # session_params with an id and no rid).
        kwargs["session_params"] = {"id": req.session_id}
    return GenerateReqInput(**kwargs)


def meta_info(meta: dict[str, Any]) -> dict[str, str]:
    """meta_info as the contract sends it: every value JSON-encoded ("12", "\\"stop\\"")."""
    encode = _json.encode
    out = {}
    for key, value in meta.items():  # once per streamed token: ints and null without the encoder
        kind = type(value)
        out[key] = (
            str(value) if kind is int else "null" if value is None else encode(value).decode()
        )
    return out


def text_response(result: dict, finished: bool) -> pb.TextGenerateResponse:
    return pb.TextGenerateResponse(
        text=result["text"], meta_info=meta_info(result["meta_info"]), finished=finished
    )


def ids_response(result: dict, finished: bool) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        output_ids=result["output_ids"], meta_info=meta_info(result["meta_info"]), finished=finished
    )


def is_finished(result: dict) -> bool:
    return result["meta_info"].get("finish_reason") is not None


def abort_message(result: dict) -> str | None:
    """Why the request was aborted (abort_all, pause, an Abort call), or None if it was not."""
    reason = result["meta_info"].get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return reason.get("message") or "aborted"
    return None
