"""The front's one request book: every request in flight in a front process, of every kind.

Generation (`TokenizerManager`), embeddings (`EmbeddingManager`) and any kind to come keep
their requests here, so the column every request passes through is written once:

- a rid is unique among the live requests of every kind ("Duplicate request ID");
- admission is bounded: past a kind's budget of requests in flight, a 429;
- the server's deadline (--request-timeout-s) aborts what still runs;
- a consumer that goes away aborts what it leaves behind;
- `end_all` ends every request at once (stopping, or a child died);
- outputs from the scheduler side find their request by rid (`on_output`), and a request
  whose output cannot be taken fails alone with a 500.

A kind adds a `RequestKind` over its own state (a `LiveRequest` subclass): how one row of an
output batch changes its request, and what it does when its request finishes, is left by its
consumer, or runs past the deadline. A request's `kind` is typed to take that request, so the
book hands each request to its own kind and the kind sees its own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

from cadence.errors import InvalidParameter, RequestError
from cadence.front import metrics
from cadence.front.normalize import duplicate_rid_message
from cadence.io_struct import AbortReq

logger = logging.getLogger(__name__)

LEFT_MESSAGE = "the client went away"

StateT = TypeVar("StateT", bound="LiveRequest")


@dataclass(kw_only=True, eq=False)
class LiveRequest:
    """One request in flight (one item of a batch, one sample of n > 1). A kind's own state
    extends it. `meta` gathers the result's meta info; its `finish_reason` is set once the
    request has ended, however it ended."""

    rid: str
    kind: RequestKind[Self]  # the kind that made it: it takes this very state
    created: float  # time.monotonic() when it was accepted
    event: asyncio.Event = field(default_factory=asyncio.Event)  # set on every change
    finished: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


class RequestKind(ABC, Generic[StateT]):
    """A kind of request (generation, embeddings, ...) as the book drives it; `StateT` is
    the kind's own state of one request."""

    @abstractmethod
    def take_output(self, req: StateT, out: Any, i: int) -> bool:
        """Adds row `i` of the output batch `out` to `req` (not finished yet); True when
        that row ends it. Raising fails `req` alone (500)."""

    def on_finish(self, req: StateT) -> None:
        """`req` has ended: by its last output, a failure or `end_all` (see `req.meta`)."""

    def on_leave(self, req: StateT, message: str) -> None:
        """The consumer went away before `req` ended; the book aborts it in the scheduler."""

    def on_deadline(self, req: StateT) -> None:
        """The server's deadline passed with `req` still running; the book aborts it."""


async def until_finished(req: LiveRequest) -> None:
    while not req.finished:
        await req.event.wait()
        req.event.clear()


class RequestBook:
    """The live requests of one front process by rid. Lives on the event loop; `send`
    reaches the scheduler (and may raise when it cannot)."""

    def __init__(
        self,
        send: Callable[[Any], None],
        worker_ipc: str | None = None,
        request_timeout_s: float | None = None,
    ):
        self.send = send
        self.worker_ipc = worker_ipc  # where the scheduler side answers this front
        self.request_timeout_s = request_timeout_s
        self.live: dict[str, LiveRequest] = {}
        # Requests that ended in an internal error of their own, by where it happened.
        self.num_request_faults: dict[str, int] = {"scheduler": 0, "detokenizer": 0, "front": 0}

    def __len__(self) -> int:
        return len(self.live)

    def get(self, rid: str) -> LiveRequest | None:
        return self.live.get(rid)

    def of_kind(self, kind: RequestKind[Any]) -> dict[str, LiveRequest]:
        """The live requests of one kind, by rid."""
        return {rid: req for rid, req in self.live.items() if req.kind is kind}

    @property
    def deadline_message(self) -> str:
        return (
            "the request ran past the server's deadline "
            f"(--request-timeout-s {self.request_timeout_s:g})"
        )

    # ---- admission -----------------------------------------------------------------------

    def check_rids(self, rids: list[str]) -> None:
        """Refuses a rid a live request of any kind already holds."""
        for rid in rids:
            if rid in self.live:
                raise InvalidParameter("rid", duplicate_rid_message(rid))

    def check_room(self, num: int, limit: int) -> None:
        """Refuses `num` more requests when the book would then hold more than `limit`."""
        if len(self.live) + num > limit:
            raise RequestError(
                429, "the server is overloaded: too many requests in flight; retry later"
            )

    @contextlib.contextmanager
    def hold(self, reqs: Sequence[LiveRequest]) -> Iterator[None]:
        """Books `reqs` for the block: their outputs find them, the deadline runs, and
        whatever has not finished when the block is left (its consumer went away, or it
        failed) is aborted in the scheduler."""
        for req in reqs:
            self.live[req.rid] = req
        deadline = None
        if self.request_timeout_s is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.call_later(self.request_timeout_s, self._expire, reqs)
        try:
            yield
        finally:
            if deadline is not None:
                deadline.cancel()
            for req in reqs:
                if self.live.get(req.rid) is req:
                    del self.live[req.rid]
                if not req.finished:
                    req.kind.on_leave(req, LEFT_MESSAGE)
                    self._abort_left(req.rid)

    def _abort_left(self, rid: str) -> None:
        try:
            self.abort(rid, LEFT_MESSAGE)
        except Exception:  # the engine is gone: nothing runs there to abort
            logger.warning("could not abort request %s after its client left", rid, exc_info=True)

    def _expire(self, reqs: Sequence[LiveRequest]) -> None:
        """The server-side deadline passed: the scheduler ends what still runs (finish reason
        abort); each kind says what its consumer gets."""
        for req in reqs:
            if not req.finished and self.live.get(req.rid) is req:
                req.kind.on_deadline(req)
                self.abort(req.rid, self.deadline_message)

    # ---- results in (on the event loop) --------------------------------------------------

    def on_output(self, out: Any) -> None:
        """An output batch (BatchStrOutput, BatchEmbeddingOutput): each row to its request."""
        for i, rid in enumerate(out.rids):
            req = self.live.get(rid)
            if req is None or req.finished:
                # The client already left (its abort is on the way), or the front ended it
                # (end_all): late outputs must not overwrite its finish reason.
                continue
            try:
                is_done = req.kind.take_output(req, out, i)
            except Exception as e:  # this request fails alone; the others get their outputs
                logger.exception(
                    "taking the output of request %s failed; it ends with an error", rid
                )
                self.fail(req, f"internal error while taking its output: {type(e).__name__}: {e}")
                continue
            if is_done:
                self.finish(req)
            else:
                req.event.set()

    def finish(self, req: LiveRequest) -> None:
        req.finished = True
        req.kind.on_finish(req)
        req.event.set()

    def fail(self, req: LiveRequest, message: str) -> None:
        """Ends `req` with a 500 of its own (the front failed it) and aborts it."""
        self.record_fault("front")
        req.meta["finish_reason"] = {
            "type": "abort",
            "status_code": 500,
            "request_fault": True,
            "message": message,
        }
        self.abort(req.rid, message)
        self.finish(req)

    def record_fault(self, origin: str) -> None:
        """A request ended in an internal error of its own at `origin` (for /metrics)."""
        self.num_request_faults[origin] = self.num_request_faults.get(origin, 0) + 1
        metrics.record_fault(origin)

    # ---- ending requests -----------------------------------------------------------------

    def abort(self, rid: str, message: str = "aborted") -> None:
        """Asks the scheduler to end request `rid` (its samples `rid-j` too)."""
        self.send(AbortReq(rid=rid, message=message, http_worker_ipc=self.worker_ipc))

    def abort_all(self, message: str = "aborted") -> None:
        self.send(AbortReq(abort_all=True, message=message, http_worker_ipc=self.worker_ipc))

    def matching(self, rid: str) -> list[str]:
        """The live rids `rid` names: itself, or the samples `rid-j` of an n > 1 request."""
        return [r for r in self.live if r == rid or r.startswith(f"{rid}-")]

    def end_all(self, message: str, status: int = 503) -> None:
        """Ends every request at once with an error of `status`, without waiting for the
        scheduler (the server is stopping, or a child died and will never answer)."""
        if not self.live:
            return
        self.abort_all(message)
        reason = {"type": "abort", "message": message, "status_code": status}
        for req in list(self.live.values()):
            if not req.finished:
                req.meta["finish_reason"] = dict(reason)
                self.finish(req)
