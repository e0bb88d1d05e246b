"""Embedding requests inside the scheduler: queued, batched under a token budget per step like
prefill, each input run in one forward pass and finished in the step that ran it.

They never decode, so they never wait behind decoding requests: every scheduler step runs
one embedding batch (when any waits) besides its prefill or decode batch. An encoder needs
no KV memory at all; a decoder served as an embedding model (--is-embedding) writes its K/V
while attending, so its inputs take pages from the KV manager for their step only and give
them back at once, never pages promised to admitted generation requests. Nothing goes into
the prefix cache: an embedding leaves no state behind.

One request may carry up to --max-embedding-batch inputs (1,024 × 512 tokens is minutes of
work on a small CPU), so no request is run whole: each step takes inputs from every waiting
request, the one that has had the fewest tokens computed first, one input each in turn,
under a budget of `MIN_STEP_TOKENS`, or what the measured speed computes in `STEP_TARGET_S`
where that is more. A one-input request that arrives behind a large one then runs in the
next step. The front gathers a request's vectors until its last input is done.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cadence.io_struct import BatchTokenizedEmbeddingReqInput, TokenizedEmbeddingReqInput
from cadence.mem_cache.kv_manager import KVHandle, KVManager
from cadence.model_executor.runner import EmbedItem, Runner

logger = logging.getLogger(__name__)

# The finish reason of a computed embedding (it "generated" nothing, like max_new_tokens 0).
FINISHED = {"type": "length", "length": 0}

# What an embedding step aims to take, where the device is fast enough: a request that
# arrives while one runs waits for it, then runs in the next, first: about twice this.
STEP_TARGET_S = 0.25
# But a step takes at least this many tokens (one input of a BERT's whole context), however
# slow the measured speed: on a small or busy CPU each step has a large fixed cost (every
# parallel operation waits for its threads; ~0.3 s a step on a 2-core machine at load 10),
# and steps that shrank with the speed would compute less and less each (one short input a
# step, 8x less throughput). MiniLM takes ~0.14 s for 512 tokens on 2 idle cores.
MIN_STEP_TOKENS = 512


@dataclass
class EmbedReq:
    """One embedding request waiting for its forward pass."""

    rid: str
    input_ids: list[int]
    token_type_ids: list[int] | None = None
    http_worker_ipc: str | None = None
    kv: KVHandle | None = None  # a decoder's KV pages, during its step only
    created: float = field(default_factory=time.monotonic)


@dataclass
class EmbedOutput:
    """A finished embedding request (the scheduler's side of BatchEmbeddingOutput)."""

    rid: str
    http_worker_ipc: str | None
    embedding: list[float] | None  # None when it was aborted or failed
    finished_reason: dict[str, Any]
    prompt_tokens: int


def failed_output(out: EmbedOutput, error: BaseException, stage: str) -> EmbedOutput:
    """`out` replaced by an internal error of its own (its output could not be sent)."""
    reason = {
        "type": "abort",
        "status_code": 500,
        "request_fault": True,
        "message": f"internal error while {stage}: {type(error).__name__}: {error}",
    }
    return EmbedOutput(out.rid, out.http_worker_ipc, None, reason, out.prompt_tokens)


def embed_req_from_tokenized(t: TokenizedEmbeddingReqInput) -> EmbedReq:
    return EmbedReq(t.rid, list(t.input_ids), t.token_type_ids, t.http_worker_ipc)


@dataclass
class _Group:
    """The waiting inputs of one embedding request (one message from the front), in order."""

    reqs: deque[EmbedReq]
    seq: int  # arrival order
    num_served: int = 0  # input tokens of its inputs computed so far


class EmbeddingQueue:
    """The scheduler's embedding requests. Single-threaded like the scheduler: only its
    thread calls these methods. A decoder's inputs take their KV pages from the KV manager
    in `_take` and give them back when their step ends."""

    def __init__(
        self,
        runner: Runner,
        kv: KVManager,
        max_step_tokens: int,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.runner = runner
        self.kv = kv
        # Most input tokens in one step (--chunked-prefill-size); a step takes one input at least.
        self.max_step_tokens = max_step_tokens
        self.clock = clock
        self.tokens_per_s: float | None = None  # measured over the last steps; None: not yet
        self.groups: list[_Group] = []
        self.num_waiting = 0  # inputs waiting, every group's together
        self._num_groups = 0  # groups ever queued: the next one's arrival order
        self.num_failed_requests = 0

    def add(self, reqs: list[EmbedReq]) -> None:
        """Queues the inputs of one request, which are scheduled together (see `_take`)."""
        if reqs:
            self.groups.append(_Group(deque(reqs), self._num_groups))
            self._num_groups += 1
            self.num_waiting += len(reqs)

    def abort(self, rid: str | None, abort_all: bool, message: str) -> list[EmbedOutput]:
        """Ends waiting inputs (`rid`, or all). No input is ever caught mid-way (one runs
        within one step and holds nothing between steps); a request whose other inputs ran
        already loses only those still waiting."""
        hit = []
        for group in self.groups:
            for req in [r for r in group.reqs if abort_all or r.rid == rid]:
                group.reqs.remove(req)
                hit.append(req)
        self._drop_empty_groups()
        self.num_waiting -= len(hit)
        return [self._end(req, None, {"type": "abort", "message": message}) for req in hit]

    def fail_message(
        self, msg: TokenizedEmbeddingReqInput | BatchTokenizedEmbeddingReqInput, error: Exception
    ) -> list[EmbedOutput]:
        """Every input of a message that could not be queued ends with `error`."""
        items = msg.batch if isinstance(msg, BatchTokenizedEmbeddingReqInput) else [msg]
        return [self.fail(embed_req_from_tokenized(item), error, "queued") for item in items]

    def fail(self, req: EmbedReq, error: BaseException, stage: str) -> EmbedOutput:
        """Ends `req` with an internal error of its own (a 500 a router must not retry)."""
        logger.error("embedding request %s failed while %s", req.rid, stage, exc_info=error)
        self.num_failed_requests += 1
        return failed_output(self._end(req, None, dict(FINISHED)), error, stage)

    # ---- a step ---------------------------------------------------------------------------

    def step_budget(self) -> int:
        """Input tokens the next step may take: what the measured speed computes in about
        `STEP_TARGET_S`, but at least `MIN_STEP_TOKENS` and at most `max_step_tokens`."""
        timed = 0 if self.tokens_per_s is None else int(self.tokens_per_s * STEP_TARGET_S)
        return min(self.max_step_tokens, max(MIN_STEP_TOKENS, timed))

    def step(self) -> list[EmbedOutput]:
        """Runs one batch of waiting inputs (as many as the step's budget takes, at least
        one); returns their outputs."""
        batch = self._take()
        if not batch:
            return []
        started = self.clock()
        try:
            return self._run(batch)
        finally:
            for req in batch:
                self._release(req)
            self._measure(sum(len(req.input_ids) for req in batch), self.clock() - started)

    def _take(self) -> list[EmbedReq]:
        """The step's inputs: passes over the waiting requests, the one with the fewest tokens
        computed first (then the oldest), each giving its next input while the budget allows,
        so that no request waits behind another one's many inputs."""
        budget = self.step_budget()
        order = sorted(self.groups, key=lambda g: (g.num_served, g.seq))
        batch: list[EmbedReq] = []
        num_tokens = 0
        while order:
            next_pass: list[_Group] = []
            for group in order:
                req = group.reqs[0]
                n = len(req.input_ids)
                if batch and num_tokens + n > budget:
                    continue  # done with it this step; another's shorter input may still fit
                if self.runner.embed_needs_kv and not self._reserve(req):
                    next_pass = []  # waits for pages; what is taken runs now
                    break
                batch.append(group.reqs.popleft())
                group.num_served += n
                num_tokens += n
                if group.reqs:
                    next_pass.append(group)
            order = next_pass
        self._drop_empty_groups()
        self.num_waiting -= len(batch)
        return batch

    def _drop_empty_groups(self) -> None:
        self.groups = [group for group in self.groups if group.reqs]

    def _measure(self, num_tokens: int, elapsed: float) -> None:
        """Folds one step's speed into `tokens_per_s` (half the weight to the newest step: it
        follows a change of load within a few steps, and one slow step only halves it)."""
        rate = num_tokens / max(elapsed, 1e-6)
        self.tokens_per_s = rate if self.tokens_per_s is None else (self.tokens_per_s + rate) / 2

    def _reserve(self, req: EmbedReq) -> bool:
        req.kv = self.kv.reserve_embedding(len(req.input_ids))
        return req.kv is not None

    def _release(self, req: EmbedReq) -> None:
        if req.kv is not None:
            self.kv.release(req.kv)
            req.kv = None

    def _run(self, batch: list[EmbedReq]) -> list[EmbedOutput]:
        try:
            vectors = self.runner.embed([self._item(req) for req in batch])
        except Exception as e:
            if len(batch) == 1:
                return [self.fail(batch[0], e, "computing its embedding")]
            # Find the request(s) at fault: each alone; the others get their embeddings.
            logger.warning("an embedding batch failed (%s); running its requests one by one", e)
            return [out for req in batch for out in self._run([req])]
        return [self._end(req, vec, dict(FINISHED)) for req, vec in zip(batch, vectors)]

    @staticmethod
    def _item(req: EmbedReq) -> EmbedItem:
        return EmbedItem(req.rid, req.input_ids, req.token_type_ids, req.kv.pages if req.kv else [])

    @staticmethod
    def _end(req: EmbedReq, vector: list[float] | None, reason: dict) -> EmbedOutput:
        return EmbedOutput(req.rid, req.http_worker_ipc, vector, reason, len(req.input_ids))
