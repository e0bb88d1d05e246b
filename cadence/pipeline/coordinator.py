"""The coordinator: the front process's handle on a pipeline whose stages run elsewhere.

It binds one PULL socket (Complete, Stream, StageReady, StageStats come in) and one PUB
socket (Abort, Shutdown, ProfilerStart/Stop, StatsQuery go out to every stage process), and
PUSHes Submit to the entry stage's process with the request's tensors inline. It knows
nothing of processes: the launcher tells it when one is ready, dies, or is back
(`mark_unhealthy` / `mark_healthy`); while unhealthy every request fails at once (503).

Stages placed in the front (`front`, a `FrontStages`) run on its own loop: a request whose
entry stage is there is handed over without a socket, their results and client chunks come
back by reference, aborts reach them with the broadcast, and what the stage processes send
them (DataReady) arrives on the coordinator's PULL.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from cadence.pipeline import channels
from cadence.pipeline.client import PipelineClient, RequestTracker
from cadence.pipeline.config import FRONT, PipelineConfig
from cadence.pipeline.errors import Failure, PipelineStartError, PipelineUnavailable
from cadence.pipeline.messages import (
    Abort,
    Complete,
    DataAck,
    DataReady,
    ProfilerStart,
    ProfilerStop,
    Shutdown,
    StageReady,
    StageStats,
    StatsQuery,
    Stream,
    Submit,
)
from cadence.pipeline.payload import buffer_from_frame, extract, restore

if TYPE_CHECKING:
    from cadence.pipeline.front import FrontStages

logger = logging.getLogger("cadence.pipeline")

HELLO_PERIOD_S = 0.02  # broadcast while processes start, so each knows its subscription is live


@dataclass(frozen=True)
class Addresses:
    """Where a pipeline's sockets listen (ipc:// paths in a private directory)."""

    coordinator: str
    broadcast: str
    processes: dict[str, str]  # process name -> its PULL (FRONT: the coordinator's)


class Coordinator(PipelineClient):
    """submit / stream / abort for a multi-process pipeline; see the module docstring."""

    def __init__(self, config: PipelineConfig, addresses: Addresses):
        self.config = config
        self.graph = config.graph
        self.addresses = addresses
        self.tracker = RequestTracker(self.graph)
        self._ctx = zmq.Context()
        self._pull = channels.bind(self._ctx, zmq.PULL, addresses.coordinator)
        self._pub = channels.bind(self._ctx, zmq.PUB, addresses.broadcast)
        entry_process = self.graph.process_of[self.graph.entry]
        self._entry = None  # the entry stage's process, unless the entry is in the front
        if entry_process != FRONT:
            self._entry = channels.connect(self._ctx, zmq.PUSH, addresses.processes[entry_process])
        self.front: FrontStages | None = None  # the stages placed in the front, if any
        self._inbox = channels.Inbox(self._pull, self._dispatch, "coordinator")
        self._handlers = {
            Complete: self._on_complete,
            Stream: self._on_stream,
            StageReady: self._on_ready,
            StageStats: self._on_stats,
            DataReady: self._on_data_ready,
            DataAck: lambda msg, frame: None,  # the front lends nothing: no credit to return
        }
        self.ready: dict[str, int] = {}  # process -> pid, for processes that reported ready
        self.start_errors: dict[str, str] = {}
        self._ready_changed: asyncio.Event | None = None
        self._stats: dict[int, tuple[asyncio.Future, dict[str, StageStats]]] = {}
        self._tokens = itertools.count(1)
        self._unhealthy_reason: str | None = "starting"
        self.on_health_change: list[Callable[[str | None], None]] = []
        """Called with the new reason (None: healthy again) whenever health flips."""
        self.closed = False

    def start(self) -> None:
        """Starts reading replies; call on the loop that will use the coordinator."""
        self._ready_changed = asyncio.Event()
        self._inbox.start()

    def host_front_stages(self) -> FrontStages:
        """The runtime of the stages placed in the front, on this coordinator's loop and
        sockets (set up by the launcher, with its caller's services)."""
        from cadence.pipeline.front import FrontStages

        self.front = FrontStages(self.config, self, self._ctx, self.addresses.processes)
        return self.front

    # -- health ---------------------------------------------------------------------------

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the pipeline cannot take requests now; None when it can."""
        return self._unhealthy_reason

    @unhealthy_reason.setter
    def unhealthy_reason(self, reason: str | None) -> None:
        flipped = (reason is None) != (self._unhealthy_reason is None)
        self._unhealthy_reason = reason
        if flipped:
            for listener in list(self.on_health_change):
                listener(reason)

    @property
    def is_healthy(self) -> bool:
        """Every stage process is up and reported ready."""
        return self.unhealthy_reason is None

    def mark_unhealthy(self, reason: str) -> list[str]:
        """Fails every request in flight with `reason` (503) and drops them on every stage;
        returns their rids. Requests refused until `mark_healthy`."""
        self.unhealthy_reason = reason
        rids = self.tracker.fail_all(PipelineUnavailable(reason))
        if rids:
            self._abort_everywhere(rids, reason)
        return rids

    def mark_healthy(self) -> None:
        self.unhealthy_reason = None

    def forget_ready(self, processes) -> None:
        for process in processes:
            self.ready.pop(process, None)
            self.start_errors.pop(process, None)

    async def wait_ready(self, processes: set[str], timeout: float, is_alive) -> None:
        """Returns once every process in `processes` reported ready; PipelineStartError if one
        reports an error, `is_alive(process)` turns False, or `timeout` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            failed = {p: e for p, e in self.start_errors.items() if p in processes}
            if failed:
                process, error = next(iter(failed.items()))
                raise PipelineStartError(f"stage process {process} failed to start: {error}")
            for process in processes:
                if process not in self.ready and not is_alive(process):
                    raise PipelineStartError(
                        f"stage process {process} died during start-up (see its log above)"
                    )
            if processes <= set(self.ready):
                return
            if loop.time() > deadline:
                missing = ", ".join(sorted(processes - set(self.ready)))
                raise PipelineStartError(f"stage process(es) {missing} not ready in {timeout} s")
            self._publish(Abort(rids=[], reason="hello"))
            self._ready_changed.clear()
            try:
                async with asyncio.timeout(HELLO_PERIOD_S):
                    await self._ready_changed.wait()
            except TimeoutError:
                pass

    # -- requests -------------------------------------------------------------------------

    def _send(self, wire: str, request: Any) -> None:
        if self.unhealthy_reason is not None:
            raise PipelineUnavailable(f"the pipeline cannot take requests: {self.unhealthy_reason}")
        if self._entry is None:
            self.front.submit(wire, request)
            return
        payload = extract(request)
        frame = payload.pack("cpu").numpy() if payload.nbytes else None
        msg = Submit(rid=wire, stage=self.graph.entry, payload=payload.header)
        channels.send(self._entry, msg, frame)

    def _abort_everywhere(self, rids: list[str], reason: str) -> None:
        self._publish(Abort(rids=rids, reason=reason))
        if self.front is not None:
            for rid in rids:
                self.front.drop(rid)

    def _publish(self, msg) -> None:
        if not self.closed:
            channels.send(self._pub, msg)

    # -- replies --------------------------------------------------------------------------

    def _dispatch(self, msg: Any, frame) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.warning("coordinator: unexpected %s", type(msg).__name__)
            return
        handler(msg, frame)

    def _on_complete(self, msg: Complete, frame) -> None:
        if msg.rid not in self.tracker.pending:
            return
        result = None
        if msg.error is None:
            result = restore(msg.payload, buffer_from_frame(frame) if frame else None)
        failure = None if msg.error is None else Failure(msg.error, msg.status, msg.param)
        self.complete(msg.rid, msg.stage, result, failure)

    def _on_stream(self, msg: Stream, frame) -> None:
        pending = self.tracker.pending.get(msg.rid)
        if pending is None:
            return
        data = None
        if msg.payload is not None and pending.queue is not None:
            data = restore(msg.payload, buffer_from_frame(frame) if frame else None)
        self.stream_chunk(msg.rid, msg.stage, msg.chunk_id, data, msg.is_done, msg.error)

    def complete(self, rid: str, stage: str, result: Any, error: Failure | None) -> None:
        """A terminal stage's result, or a stage's failure of request `rid` (a wire id)."""
        if self.tracker.complete(rid, stage, result, error):
            self._abort_everywhere([rid], f"stage {stage} failed")

    def stream_chunk(
        self, rid: str, stage: str, chunk_id: int, data: Any, is_done: bool, error: str | None
    ) -> None:
        """A chunk for the client (or the end, or the failure, of a stage's chunks)."""
        if self.tracker.chunk(rid, stage, chunk_id, data, is_done, error):
            self._abort_everywhere([rid], f"stage {stage} failed")

    def _on_data_ready(self, msg: DataReady, frame) -> None:
        if self.front is None:
            logger.warning("coordinator: a DataReady for %s, which is not in the front", msg.stage)
            return
        self.front.on_data_ready(msg, frame)

    def _on_ready(self, msg: StageReady, frame) -> None:
        if msg.error is not None:
            self.start_errors[msg.process] = msg.error
        else:
            self.ready[msg.process] = msg.pid
        self._ready_changed.set()

    def _on_stats(self, msg: StageStats, frame) -> None:
        entry = self._stats.get(msg.token)
        if entry is not None:
            future, got = entry
            got[msg.process] = msg
            if set(got) >= set(self.ready) and not future.done():
                future.set_result(got)

    # -- operations -----------------------------------------------------------------------

    async def stage_stats(self, timeout: float = 5.0) -> dict[str, StageStats]:
        """Each ready process's StageStats: rids it holds state for, relay accounting (the
        front's too, under FRONT, when stages are placed there)."""
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        got: dict[str, StageStats] = {}
        self._stats[token] = (future, got)
        self._publish(StatsQuery(token=token))
        try:
            if self.ready:
                async with asyncio.timeout(timeout):
                    await future
        except TimeoutError:
            missing = ", ".join(sorted(set(self.ready) - set(got)))
            raise TimeoutError(f"no stats from {missing} in {timeout} s") from None
        finally:
            del self._stats[token]
        if self.front is not None:
            got[FRONT] = StageStats(
                token=token, process=FRONT, pid=os.getpid(), live=self.front.live(), relay={}
            )
        return got

    def start_profile(self, output_dir: str) -> None:
        self._publish(ProfilerStart(output_dir=output_dir))

    def stop_profile(self) -> None:
        self._publish(ProfilerStop())

    def shutdown_stages(self) -> None:
        self._publish(Shutdown())

    def close(self) -> None:
        """Fails what is still in flight and closes the sockets."""
        if self.closed:
            return
        self.tracker.fail_all(PipelineUnavailable("the pipeline is shutting down"))
        self.unhealthy_reason = "closed"
        self.closed = True
        self._inbox.stop()
        if self.front is not None:
            self.front.close()
        for sock in (self._pull, self._pub, self._entry):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
