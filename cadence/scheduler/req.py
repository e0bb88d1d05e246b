"""A request's life inside the scheduler, and the per-step output it produces."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from cadence.io_struct import (
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    Logprobs,
    SamplingParams,
    SessionParams,
    TokenizedGenerateReqInput,
)
from cadence.mem_cache.kv_manager import KVHandle
from cadence.model_executor.runner import TokenLogprob
from cadence.scheduler.embedding import EmbedOutput

_uids = itertools.count()


@dataclass
class ReqOutput:
    """What one step produced for one request (the scheduler's side of BatchTokenIDOutput)."""

    rid: str
    new_ids: list[int]  # tokens generated since the last output of this request
    finished_reason: (
        dict[str, Any] | None
    )  # {"type": "stop"|"length"|"abort", ...}; None while running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    http_worker_ipc: str | None
    params: SamplingParams
    return_logprob: bool = False
    output_logprobs: list[TokenLogprob] | None = None  # (logprob, id) of each new token
    output_top_logprobs: list[list[TokenLogprob] | None] | None = None
    output_token_ids_logprobs: list[list[TokenLogprob] | None] | None = None
    input_logprobs: list[TokenLogprob] | None = None  # prompt tokens, sent once
    input_top_logprobs: list[list[TokenLogprob]] | None = None
    input_token_ids_logprobs: list[list[TokenLogprob]] | None = None
    hidden_states: list[list[float]] | None = None  # new positions' final hidden states
    # (verify steps, accepted draft tokens, proposed draft tokens, acceptance histogram)
    # once speculation is on for it
    spec: tuple[int, int, int, list[int]] | None = None


@dataclass
class Req:
    """One request's life inside the scheduler: what it asked for, where its KV lives, what
    it produced and has yet to report."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    http_worker_ipc: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is reported; -1: none
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    priority: int | None = None  # None: the lowest (see Scheduler.add_request)
    return_hidden_states: bool = False
    logit_processor: str | None = None  # a registered processor's name
    # Its constraint at its current position (cadence.constrained.Grammar), once compiled;
    # the sampler masks with it and `Scheduler._apply` advances it by every token.
    grammar: Any = None
    session_params: SessionParams | None = None  # continues a session (see scheduler/sessions.py)
    lora_name: str | None = None  # the LoRA adapter it asked for; None: the base model
    # The adapter it holds while it lives (model_executor.lora_manager.LoraAdapter), and
    # that adapter's uid: its KV namespace in the prefix cache (None: the base model's).
    lora: Any = None
    lora_uid: int | None = None
    # Prefill/decode disaggregation: (prefill host, bootstrap port, room); None: both halves
    # run here.
    bootstrap: tuple[str | None, int | None, int] | None = None

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    uid: int = field(default_factory=_uids.__next__)  # unique per object, unlike a rid
    kv: KVHandle | None = None  # its KV pages and reservation while admitted (chunked or running)
    was_admitted: bool = False  # admitted once (a retracted request is not counted again)
    num_computed: int = 0  # tokens of fill_ids whose K/V are in the pool
    num_sent: int = 0  # output tokens already reported
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    match_len: int = -1  # cached whole-page prefix length, as of prefix-cache version `match_at`
    match_at: int = -1
    page_hashes: list[int] = field(default_factory=list)  # chained hashes of fill_ids' pages
    session_turn: Any = None  # its turn in an open session
    session_id: str | None = None
    generator: Any = None  # the runner's random generator for a request with a seed
    decode_turn: int = 0  # when it last decoded, in decode items scheduled (lanes go by it)
    created: float = field(default_factory=time.monotonic)
    # Logprobs gathered since the last output (cleared when sent).
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_top: list[list[TokenLogprob] | None] = field(default_factory=list)
    pending_given: list[list[TokenLogprob] | None] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] | None = None
    input_top: list[list[TokenLogprob]] | None = None
    input_given: list[list[TokenLogprob]] | None = None
    input_logprobs_sent: bool = False
    pending_hidden: list[list[float]] = field(default_factory=list)  # not reported yet
    num_hidden_positions: int = 0  # positions whose hidden state was recorded
    # Speculative decoding (SGLang's SpeculativeDecodingMetricsMixin, per request): verify
    # steps, draft tokens accepted (the sampled token after them not counted), and how many
    # steps accepted 0, 1, 2, ... draft tokens; `spec_pace` is its drafting pace.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_proposed_tokens: int = 0  # draft tokens verified (accepted or not)
    spec_acceptance_histogram: list[int] = field(default_factory=list)
    spec_pace: Any = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose K/V the request needs: the prompt, then what it generated."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def is_admitted(self) -> bool:
        """It holds its KV reservation (chunked or running)."""
        return self.kv is not None

    @property
    def admitted_kv(self) -> KVHandle:
        """Its KV handle; asking before admission is a scheduling bug."""
        if self.kv is None:
            raise RuntimeError(f"request {self.rid} holds no KV pages: it was not admitted")
        return self.kv

    @property
    def pages(self) -> list[int]:
        """Its KV pages in position order (none while it is not admitted)."""
        return self.kv.pages if self.kv is not None else []

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    def total_tokens_needed(self, context_len: int) -> int:
        """Tokens this request can ever hold: the prompt plus every token it may generate."""
        return min(len(self.input_ids) + self.params.max_new_tokens, context_len)

    # ---- what it reports --------------------------------------------------------------

    def append_token(
        self,
        token: int,
        logprob: float | None,
        top: list[TokenLogprob] | None,
        given: list[TokenLogprob] | None,
    ) -> None:
        """A sampled token joins the output (its logprobs too, when asked for)."""
        self.output_ids.append(token)
        if self.return_logprob:
            self.pending_logprobs.append((logprob, token))
            self.pending_top.append(top)
            self.pending_given.append(given)

    def record_input_logprobs(
        self,
        logprobs: list[TokenLogprob],
        top: list[list[TokenLogprob]],
        given: list[list[TokenLogprob]],
    ) -> None:
        """Keeps a prefill chunk's prompt logprobs (sent with its next output)."""
        if self.input_logprobs is None or self.input_top is None or self.input_given is None:
            self.input_logprobs, self.input_top, self.input_given = [], [], []
            if self.logprob_start_len == 0:  # the first prompt token: nothing predicts it
                self.input_logprobs.append((None, self.input_ids[0]))
                self.input_top.append([])
                self.input_given.append([])
        self.input_logprobs.extend(logprobs)
        self.input_top.extend(top)
        self.input_given.extend(given)

    def record_hidden_states(self, start: int, states: list[list[float]]) -> None:
        """Keeps the hidden states of positions not recorded yet (a retracted request
        computes its earlier positions again)."""
        skip = max(self.num_hidden_positions - start, 0)
        self.pending_hidden.extend(states[skip:])
        self.num_hidden_positions = max(self.num_hidden_positions, start + len(states))

    def next_output(self) -> ReqOutput:
        """What it has produced since its last output (and, at the end, its finish reason);
        what this output carries counts as reported."""
        new_ids = self.output_ids[self.num_sent :]
        self.num_sent = len(self.output_ids)
        out = ReqOutput(
            self.rid,
            new_ids,
            self.finished_reason,
            len(self.input_ids),
            len(self.output_ids),
            self.cached_tokens,
            self.http_worker_ipc,
            self.params,
            self.return_logprob,
        )
        if self.pending_hidden:
            out.hidden_states, self.pending_hidden = self.pending_hidden, []
        if self.spec_pace is not None:
            out.spec = (
                self.spec_verify_ct,
                self.spec_accepted_tokens,
                self.spec_proposed_tokens,
                list(self.spec_acceptance_histogram),
            )
        if self.return_logprob:
            out.output_logprobs, self.pending_logprobs = self.pending_logprobs, []
            out.output_top_logprobs, self.pending_top = self.pending_top, []
            out.output_token_ids_logprobs, self.pending_given = self.pending_given, []
            if not self.input_logprobs_sent and (
                self.input_logprobs is not None or self.is_finished or new_ids
            ):
                out.input_logprobs = self.input_logprobs or []
                out.input_top_logprobs = self.input_top or []
                out.input_token_ids_logprobs = self.input_given or []
                self.input_logprobs_sent = True
        return out


def is_sample_of(rid: str, parent: str | None) -> bool:
    """Whether `rid` is sample j of the n > 1 request `parent` (f"{parent}-{j}")."""
    return (
        parent is not None
        and rid.startswith(parent)
        and rid[len(parent) : len(parent) + 1] == "-"
        and rid[len(parent) + 1 :].isdigit()
    )


def req_from_tokenized(t: TokenizedGenerateReqInput) -> Req:
    """The scheduler's request for a tokenized request from the front."""
    return Req(
        rid=t.rid,
        input_ids=list(t.input_ids),
        params=t.sampling_params,
        http_worker_ipc=t.http_worker_ipc,
        return_logprob=t.return_logprob,
        logprob_start_len=t.logprob_start_len,
        top_logprobs_num=t.top_logprobs_num,
        token_ids_logprob=t.token_ids_logprob,
        stream=t.stream,
        priority=t.priority,
        return_hidden_states=t.return_hidden_states,
        logit_processor=t.custom_logit_processor,
        session_params=t.session_params,
        lora_name=t.lora_path,
        bootstrap=(
            None
            if t.bootstrap_room is None
            else (t.bootstrap_host, t.bootstrap_port, t.bootstrap_room)
        ),
    )


def _split(pairs):
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _split_nested(rows):
    vals = [[v for v, _ in row] if row is not None else None for row in rows]
    idxs = [[i for _, i in row] if row is not None else None for row in rows]
    return vals, idxs


def _logprobs(out: ReqOutput) -> Logprobs | None:
    if not out.return_logprob:
        return None
    lp = Logprobs()
    lp.output_token_logprobs_val, lp.output_token_logprobs_idx = _split(out.output_logprobs or [])
    lp.output_top_logprobs_val, lp.output_top_logprobs_idx = _split_nested(
        out.output_top_logprobs or []
    )
    lp.output_token_ids_logprobs_val, lp.output_token_ids_logprobs_idx = _split_nested(
        out.output_token_ids_logprobs or []
    )
    if out.input_logprobs is not None:
        lp.input_token_logprobs_val, lp.input_token_logprobs_idx = _split(out.input_logprobs)
        lp.input_top_logprobs_val, lp.input_top_logprobs_idx = _split_nested(
            out.input_top_logprobs or []
        )
        lp.input_token_ids_logprobs_val, lp.input_token_ids_logprobs_idx = _split_nested(
            out.input_token_ids_logprobs or []
        )
    return lp


def to_batch_output(outs: list[ReqOutput], weight_version: str) -> BatchTokenIDOutput:
    """Packs one step's per-request outputs into the message for the detokenizer."""
    logprobs = [_logprobs(o) for o in outs]
    return BatchTokenIDOutput(
        rids=[o.rid for o in outs],
        http_worker_ipcs=[o.http_worker_ipc for o in outs],
        finished_reasons=[o.finished_reason for o in outs],
        output_ids=[o.new_ids for o in outs],
        skip_special_tokens=[o.params.skip_special_tokens for o in outs],
        spaces_between_special_tokens=[o.params.spaces_between_special_tokens for o in outs],
        no_stop_trim=[o.params.no_stop_trim for o in outs],
        stop_strs=[o.params.stop for o in outs],
        prompt_tokens=[o.prompt_tokens for o in outs],
        completion_tokens=[o.completion_tokens for o in outs],
        cached_tokens=[o.cached_tokens for o in outs],
        logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
        hidden_states=(
            [o.hidden_states for o in outs] if any(o.hidden_states for o in outs) else None
        ),
        **_spec_fields(outs),
        weight_version=weight_version,
    )


def _spec_fields(outs: list[ReqOutput]) -> dict[str, Any]:
    """SGLang's per-request speculative metrics, when a request in the batch has drafted."""
    if not any(o.spec is not None for o in outs):
        return {}
    specs = [o.spec or (0, 0, 0, []) for o in outs]
    return {
        "spec_verify_ct": [s[0] for s in specs],
        "spec_accepted_tokens": [s[1] for s in specs],
        "spec_proposed_tokens": [s[2] for s in specs],
        "spec_acceptance_histogram": [s[3] for s in specs],
    }


def to_messages(
    outs: list[ReqOutput | EmbedOutput], weight_version: str
) -> list[BatchTokenIDOutput | BatchEmbeddingOutput]:
    """One step's outputs as the messages that carry them: one BatchTokenIDOutput for the
    generation requests (the detokenizer's work; stamped with the served `weight_version`),
    one BatchEmbeddingOutput per front process for the embedding requests (passed through
    the detokenizer untouched)."""
    tokens = [o for o in outs if not isinstance(o, EmbedOutput)]
    messages: list = [to_batch_output(tokens, weight_version)] if tokens else []
    by_front: dict[str | None, list[EmbedOutput]] = {}
    for o in outs:
        if isinstance(o, EmbedOutput):
            by_front.setdefault(o.http_worker_ipc, []).append(o)
    for front, group in by_front.items():
        messages.append(
            BatchEmbeddingOutput(
                rids=[o.rid for o in group],
                http_worker_ipcs=[front] * len(group),
                finished_reasons=[o.finished_reason for o in group],
                embeddings=[o.embedding for o in group],
                prompt_tokens=[o.prompt_tokens for o in group],
                cached_tokens=[0] * len(group),
            )
        )
    return messages
