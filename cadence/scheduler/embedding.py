"""Embedding requests inside the scheduler: queued, batched under a token budget per step like
prefill, each run in one forward pass and finished in the step that ran it.

They never decode, so they never wait behind decoding requests: every scheduler step runs
one embedding batch (when any waits) besides its prefill or decode batch. An encoder needs
no KV memory at all; a decoder served as an embedding model (--is-embedding) writes its K/V
while attending, so its requests take pages for their step only and give them back at
once. Nothing goes into the prefix cache: an embedding leaves no state behind.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cadence.io_struct import TokenizedEmbeddingReqInput
from cadence.mem_cache.allocator import KVAllocator
from cadence.model_executor.runner import EmbedItem, Runner

logger = logging.getLogger(__name__)

# The finish reason of a computed embedding (it "generated" nothing, like max_new_tokens 0).
FINISHED = {"type": "length", "length": 0}


@dataclass
class EmbedReq:
    """One embedding request waiting for its forward pass."""

    rid: str
    input_ids: list[int]
    token_type_ids: list[int] | None = None
    http_worker_ipc: str | None = None
    pages: list[int] = field(default_factory=list)  # a decoder's KV pages, during its step only
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


class EmbeddingQueue:
    """The scheduler's embedding requests. Single-threaded like the scheduler: only its
    thread calls these methods."""

    def __init__(self, runner: Runner, allocator: KVAllocator, prefix_cache, budget: int):
        self.runner = runner
        self.allocator = allocator
        self.cache = prefix_cache  # evicted from when a decoder's pages run short
        self.budget = budget  # input tokens per step (--chunked-prefill-size); one request at least
        self.waiting: deque[EmbedReq] = deque()
        self.num_failed_requests = 0

    def add(self, req: EmbedReq) -> None:
        self.waiting.append(req)

    def abort(self, rid: str | None, abort_all: bool, message: str) -> list[EmbedOutput]:
        """Ends waiting requests (`rid`, or all); a request runs within one step, so none is
        ever caught mid-way."""
        hit = [req for req in self.waiting if abort_all or req.rid == rid]
        for req in hit:
            self.waiting.remove(req)
        return [self._end(req, None, {"type": "abort", "message": message}) for req in hit]

    def fail(self, req: EmbedReq, error: BaseException, stage: str) -> EmbedOutput:
        """Ends `req` with an internal error of its own (a 500 a router must not retry)."""
        logger.error("embedding request %s failed while %s", req.rid, stage, exc_info=error)
        self.num_failed_requests += 1
        return failed_output(self._end(req, None, dict(FINISHED)), error, stage)

    # ---- a step ---------------------------------------------------------------------------

    def step(self) -> list[EmbedOutput]:
        """Runs one batch of waiting requests (as many as the token budget takes, at least
        one); returns their outputs."""
        batch = self._take()
        if not batch:
            return []
        try:
            return self._run(batch)
        finally:
            for req in batch:
                self._release(req)

    def _take(self) -> list[EmbedReq]:
        batch: list[EmbedReq] = []
        num_tokens = 0
        while self.waiting:
            req = self.waiting[0]
            n = len(req.input_ids)
            if batch and num_tokens + n > self.budget:
                break
            if self.runner.embed_needs_kv and not self._reserve(req):
                break  # waits for pages; what is taken runs now
            batch.append(self.waiting.popleft())
            num_tokens += n
        return batch

    def _reserve(self, req: EmbedReq) -> bool:
        need = self.allocator.pages_for(len(req.input_ids))
        free = self.allocator.num_free_pages
        if need > free and need <= free + self.cache.num_evictable_pages:
            self.cache.evict(need - free)
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        req.pages = pages
        return True

    def _release(self, req: EmbedReq) -> None:
        if req.pages:
            self.allocator.decref(req.pages)
            req.pages = []

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
        return EmbedItem(req.rid, req.input_ids, req.token_type_ids, req.pages)

    @staticmethod
    def _end(req: EmbedReq, vector: list[float] | None, reason: dict) -> EmbedOutput:
        return EmbedOutput(req.rid, req.http_worker_ipc, vector, reason, len(req.input_ids))
