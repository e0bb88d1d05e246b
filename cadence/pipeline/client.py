"""The client's side of a pipeline: requests in flight, their results and their streams.

`PipelineClient` is the interface the front process (and tests) use: `submit`, `stream`,
`abort`. Two implementations: the `Coordinator` (stages in their own processes, over ZMQ)
and the `LocalPipeline` (the whole graph in this process, the reference the other is
checked against). A request ends when every terminal stage has completed and every stage
that streams to the client has ended its stream; the first error ends it at once.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cadence.pipeline.config import PipelineGraph
from cadence.pipeline.errors import Failure, RequestAborted, StageFailed


@dataclass(frozen=True)
class StreamItem:
    """What `stream()` yields: a stage's chunk, or (chunk_id None) a terminal stage's result."""

    stage: str
    data: Any
    chunk_id: int | None = None

    @property
    def is_final(self) -> bool:
        return self.chunk_id is None


_END = object()


class _Pending:
    __slots__ = ("rid", "wire", "future", "queue", "terminals", "streams", "results")

    def __init__(self, rid: str, wire: str, graph: PipelineGraph, want_stream: bool):
        self.rid = rid  # the caller's id
        self.wire = wire  # the id on the wire: unique per submission, even if `rid` is reused
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue | None = asyncio.Queue() if want_stream else None
        self.terminals = set(graph.terminals)
        self.streams = set(graph.client_streams)
        self.results: dict[str, Any] = {}


class RequestTracker:
    """Requests in flight on the client side, by wire id; every method runs on the loop's
    thread. A caller's rid gets a fresh wire id per submission, so that stages, which remember
    dropped ids for a while, never mistake a reused rid for a late message."""

    def __init__(self, graph: PipelineGraph):
        self.graph = graph
        self.pending: dict[str, _Pending] = {}  # wire id -> request
        self.wire_of: dict[str, str] = {}  # caller's rid -> wire id
        self._seq = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:12]  # of the rids given to requests sent without one

    def new_rid(self) -> str:
        """A rid for a request sent without one: unique here, and cheaper than a uuid4 per
        request (a control round trip is tens of microseconds)."""
        return f"{self._prefix}-{next(self._seq)}"

    def open(self, rid: str, want_stream: bool) -> _Pending:
        if rid in self.wire_of:
            raise ValueError(f"request id {rid!r} is already in flight")
        wire = f"{rid}~{next(self._seq)}"
        pending = self.pending[wire] = _Pending(rid, wire, self.graph, want_stream)
        self.wire_of[rid] = wire
        return pending

    def complete(self, rid: str, stage: str, result: Any, error: Failure | None) -> bool:
        """A Complete arrived; True when it failed the request (the caller aborts it)."""
        pending = self.pending.get(rid)
        if pending is None:
            return False
        if error is not None:
            return self.fail(rid, error.error())
        pending.results[stage] = result
        pending.terminals.discard(stage)
        self._maybe_done(rid, pending)
        return False

    def chunk(
        self, rid: str, stage: str, chunk_id: int, data: Any, is_done: bool, error: str | None
    ) -> bool:
        """A Stream arrived; True when it failed the request."""
        pending = self.pending.get(rid)
        if pending is None:
            return False
        if error is not None:
            return self.fail(rid, StageFailed(error))
        if is_done:
            pending.streams.discard(stage)
            self._maybe_done(rid, pending)
        elif pending.queue is not None:
            pending.queue.put_nowait(StreamItem(stage, data, chunk_id))
        return False

    def fail(self, rid: str, error: Exception) -> bool:
        """Ends request `rid` (a wire id) with `error`; False if it was not in flight."""
        pending = self.pending.pop(rid, None)
        if pending is None:
            return False
        self.wire_of.pop(pending.rid, None)
        if not pending.future.done():
            pending.future.set_exception(error)
            pending.future.exception()  # retrieved: a stream() client does not await it
        if pending.queue is not None:
            pending.queue.put_nowait(error)
        return True

    def fail_all(self, error: Exception) -> list[str]:
        rids = list(self.pending)
        for rid in rids:
            self.fail(rid, error)
        return rids

    def _maybe_done(self, rid: str, pending: _Pending) -> None:
        if pending.terminals or pending.streams:
            return
        del self.pending[rid]
        self.wire_of.pop(pending.rid, None)
        results = pending.results
        value = results[self.graph.terminals[0]] if len(self.graph.terminals) == 1 else results
        if not pending.future.done():  # cancelled: its caller is on the way to abort it
            pending.future.set_result(value)
        if pending.queue is not None:  # results last: after every chunk, whichever came first
            for stage in self.graph.terminals:
                pending.queue.put_nowait(StreamItem(stage, results[stage]))
            pending.queue.put_nowait(_END)


class PipelineClient(ABC):
    """submit / stream / abort over a `RequestTracker`; subclasses move the messages.

    A caller that stops waiting (cancelled, or leaves a stream early) aborts its request:
    nothing goes on computing for nobody."""

    tracker: RequestTracker

    @abstractmethod
    def _send(self, wire: str, request: Any) -> None:
        """Hands the request to the entry stage; raises if the pipeline cannot take it."""

    @abstractmethod
    def _abort_everywhere(self, rids: list[str], reason: str) -> None: ...

    async def submit(self, request: Any, rid: str | None = None, timeout: float | None = None):
        """The terminal stage's result (a dict by stage name when there are several)."""
        rid = rid or self.tracker.new_rid()
        pending = self._open(rid, request, want_stream=False)
        try:
            if timeout is None:  # awaited directly: no shield's extra hop per request
                return await pending.future
            async with asyncio.timeout(timeout):
                return await asyncio.shield(pending.future)
        except TimeoutError:
            self.abort(rid, f"no result within {timeout} s")
            raise
        except asyncio.CancelledError:
            self.abort(rid, "the caller went away")
            raise

    async def stream(self, request: Any, rid: str | None = None) -> AsyncIterator[StreamItem]:
        """Chunks from the stages that stream to the client as they come (in order per stage),
        then each terminal stage's result (`is_final`), once every stream has ended."""
        rid = rid or self.tracker.new_rid()
        pending = self._open(rid, request, want_stream=True)
        finished = False
        try:
            while True:
                item = await pending.queue.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                self.abort(rid, "the caller stopped reading the stream")

    def abort(self, rid: str, reason: str = "aborted by the client") -> bool:
        """Ends the request at once (its caller gets RequestAborted) and drops it on every
        stage; False if it was not in flight."""
        wire = self.tracker.wire_of.get(rid)
        if wire is None:
            return False
        self.tracker.fail(wire, RequestAborted(f"request {rid} was aborted: {reason}"))
        self._abort_everywhere([wire], reason)
        return True

    def _open(self, rid: str, request: Any, want_stream: bool) -> _Pending:
        pending = self.tracker.open(rid, want_stream)
        try:
            self._send(pending.wire, request)
        except BaseException:
            self.tracker.pending.pop(pending.wire, None)
            self.tracker.wire_of.pop(rid, None)
            raise
        return pending
