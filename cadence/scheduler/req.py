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
    output_logprobs: list[tuple[float, int]] | None = None  # (logprob, id) of each new token
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    input_logprobs: list[tuple[float | None, int]] | None = None  # prompt tokens, sent once
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    hidden_states: list[list[float]] | None = None  # new positions' final hidden states


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

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    uid: int = field(default_factory=_uids.__next__)  # unique per object, unlike a rid
    is_admitted: bool = False  # took its KV reservation (chunked or running)
    pages: list[int] = field(default_factory=list)  # KV pages held, in position order
    num_reserved_pages: int = 0  # pages promised at admission (held + still to allocate)
    num_computed: int = 0  # tokens of fill_ids whose K/V are in the pool
    num_sent: int = 0  # output tokens already reported
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    cache_node: Any = None  # the prefix-cache node this request keeps locked (its shared prefix)
    match_len: int = -1  # cached whole-page prefix length, as of prefix-cache version `match_at`
    match_at: int = -1
    page_hashes: list[int] = field(default_factory=list)  # chained hashes of fill_ids' pages
    session_turn: Any = None  # its turn in an open session
    session_id: str | None = None
    generator: Any = None  # the runner's random generator for a request with a seed
    created: float = field(default_factory=time.monotonic)
    # Logprobs gathered since the last output (cleared when sent).
    pending_logprobs: list[tuple[float, int]] = field(default_factory=list)
    pending_top: list[list[tuple[float, int]]] = field(default_factory=list)
    pending_given: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top: list[list[tuple[float, int]]] | None = None
    input_given: list[list[tuple[float, int]]] | None = None
    input_logprobs_sent: bool = False
    pending_hidden: list[list[float]] = field(default_factory=list)  # not reported yet
    num_hidden_positions: int = 0  # positions whose hidden state was recorded

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
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    def total_tokens_needed(self, context_len: int) -> int:
        """Tokens this request can ever hold: the prompt plus every token it may generate."""
        return min(len(self.input_ids) + self.params.max_new_tokens, context_len)


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


def to_batch_output(outs: list[ReqOutput]) -> BatchTokenIDOutput:
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
    )


def to_messages(
    outs: list[ReqOutput | EmbedOutput],
) -> list[BatchTokenIDOutput | BatchEmbeddingOutput]:
    """One step's outputs as the messages that carry them: one BatchTokenIDOutput for the
    generation requests (the detokenizer's work), one BatchEmbeddingOutput per front process
    for the embedding requests (passed through the detokenizer untouched)."""
    tokens = [o for o in outs if not isinstance(o, EmbedOutput)]
    messages: list = [to_batch_output(tokens)] if tokens else []
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
