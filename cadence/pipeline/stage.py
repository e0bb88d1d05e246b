"""One stage inside its process: per-request state, the executor's run, and routing.

A request's state on a stage lives from its first input (or stream chunk) until its run has
ended and every transfer it started has completed, or until it is aborted; `requests` holds
nothing else, and a leak check reads it. Inputs arrive as awaitables (a relay get in flight,
or an object from a colocated stage), so the run can start as soon as every input is
announced and receive them as they land.

Routing of a run's outcome:
    result  -> each `next` stage (fan-out), the client if `terminal`
    chunks  -> each `stream_to` stage (`emit`), the client if `stream_to_client`
    end     -> control-only stream end to stream edges and the client stream
    failure -> Complete(error) to the client, stream error to stream edges
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cadence.errors import CadenceError
from cadence.pipeline.config import CLIENT, PipelineGraph, StageConfig
from cadence.pipeline.errors import Failure
from cadence.pipeline.executor import ChunkStream, Executor, StageRequest

logger = logging.getLogger(__name__)


class Outbox(Protocol):
    """Where a stage's outputs go; the process (or the in-process pipeline) provides it."""

    async def send(
        self, rid: str, src: str, dst: str, data: Any, chunk_id: int | None
    ) -> Awaitable[None] | None:
        """Delivers `data` to stage `dst`; returns what completes with the transfer (None when
        nothing is left to wait for). May wait for a relay credit."""

    def signal(self, rid: str, src: str, dst: str, chunk_id: int, error: str | None) -> None:
        """Control-only: the stream from `src` to `dst` ended (or failed) after chunk_id chunks."""

    def complete(self, rid: str, stage: str, result: Any = None, error: Failure | None = None):
        """A terminal result, or any stage's failure of the request, to the client."""

    def stream_client(
        self,
        rid: str,
        stage: str,
        chunk_id: int,
        data: Any = None,
        is_done: bool = False,
        error: str | None = None,
    ) -> None:
        """A chunk (or the end of this stage's chunks) to the client."""


class _RequestState:
    __slots__ = ("inputs", "stream", "task", "transfers", "num_emitted")

    def __init__(self, has_stream: bool):
        self.inputs: dict[str, Awaitable] = {}
        self.stream = ChunkStream() if has_stream else None
        self.task: asyncio.Task | None = None
        self.transfers: list[Awaitable] = []
        self.num_emitted = 0


class StageRuntime:
    """The requests one stage holds, and the rules that start, route and end them."""

    def __init__(
        self,
        cfg: StageConfig,
        graph: PipelineGraph,
        executor: Executor,
        outbox: Outbox,
        merge: Callable[[dict[str, Any]], Any] | None = None,
        on_finished: Callable[[str, bool], None] | None = None,
    ):
        self.cfg = cfg
        self.name = cfg.name
        self.executor = executor
        self.outbox = outbox
        self.merge = merge
        self.on_finished = on_finished  # (rid, stream still open) once a request's state is gone
        self.expected = (CLIENT,) if graph.entry == cfg.name else graph.data_inputs[cfg.name]
        self.has_stream = cfg.name in graph.stream_input
        self.requests: dict[str, _RequestState] = {}

    # -- inputs ---------------------------------------------------------------------------

    def on_input(self, rid: str, src: str, value: Awaitable) -> None:
        state = self._state(rid)
        state.inputs[src] = value
        if state.task is None and len(state.inputs) == len(self.expected):
            self._start(rid, state)

    def on_chunk(
        self,
        rid: str,
        src: str,
        chunk_id: int,
        value: Awaitable | None,
        is_done: bool,
        error: str | None,
    ) -> None:
        state = self._state(rid)
        if state.stream is None:
            return  # not a stream consumer: ignore (validation makes this unreachable)
        if value is not None:
            state.stream.push(value)
        if is_done:
            state.stream.close(error)
        if state.task is None and not self.expected:
            self._start(rid, state)

    def abort(self, rid: str) -> bool:
        """Drops the request: its run is cancelled, its transfers stop being waited for."""
        state = self.requests.pop(rid, None)
        if state is None:
            return False
        if state.task is not None:
            state.task.cancel()
        for transfer in state.transfers:
            if isinstance(transfer, asyncio.Future):
                transfer.cancel()
        return True

    def _state(self, rid: str) -> _RequestState:
        state = self.requests.get(rid)
        if state is None:
            state = self.requests[rid] = _RequestState(self.has_stream)
        return state

    def _start(self, rid: str, state: _RequestState) -> None:
        state.task = asyncio.get_running_loop().create_task(
            self._run(rid, state), name=f"{self.name}:{rid}"
        )

    # -- the run --------------------------------------------------------------------------

    async def _run(self, rid: str, state: _RequestState) -> None:
        try:
            try:
                data = await self._gather(state)
                req = StageRequest(rid, self.name, data, state.stream, self._emitter(rid, state))
                result = await self.executor.run(req)
                await self._route(rid, state, result)
                await self._settle(state)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.debug("stage %s failed request %s", self.name, rid, exc_info=True)
                self._fail(rid, state, failure(self.name, e))
        finally:
            if self.requests.get(rid) is state:
                del self.requests[rid]
                if self.on_finished is not None:
                    self.on_finished(rid, state.stream is not None and not state.stream.is_closed)

    async def _gather(self, state: _RequestState) -> Any:
        if not self.expected:
            return None
        values = {}
        for src in self.expected:
            value = state.inputs[src]
            if isinstance(value, asyncio.Future) and value.done():
                values[src] = value.result()  # arrived whole (inline, colocated): no wait
            else:
                # Shielded: a cancelled run must not cancel a relay get before it ran (its
                # sender's put would then never be drained).
                values[src] = await asyncio.shield(value)
        if self.merge is not None:
            return self.merge(values)
        return values[self.expected[0]]

    def _emitter(self, rid: str, state: _RequestState):
        async def emit(chunk: Any) -> None:
            self._reap(state)
            chunk_id = state.num_emitted
            state.num_emitted += 1
            for dst in self.cfg.stream_to:
                transfer = await self.outbox.send(rid, self.name, dst, chunk, chunk_id)
                if transfer is not None:
                    state.transfers.append(transfer)
            if self.cfg.stream_to_client:
                self.outbox.stream_client(rid, self.name, chunk_id, chunk)

        return emit

    async def _route(self, rid: str, state: _RequestState, result: Any) -> None:
        for dst in self.cfg.stream_to:
            self.outbox.signal(rid, self.name, dst, state.num_emitted, None)
        if self.cfg.stream_to_client:
            self.outbox.stream_client(rid, self.name, state.num_emitted, is_done=True)
        for dst in self.cfg.next:
            transfer = await self.outbox.send(rid, self.name, dst, result, None)
            if transfer is not None:
                state.transfers.append(transfer)
        if self.cfg.terminal:
            self.outbox.complete(rid, self.name, result)

    async def _settle(self, state: _RequestState) -> None:
        """Waits for every transfer this run started; the first failure fails the request."""
        while state.transfers:
            await state.transfers.pop()

    def _reap(self, state: _RequestState) -> None:
        """Forgets finished transfers (a long stream starts many); raises the first failure."""
        pending = []
        for transfer in state.transfers:
            if isinstance(transfer, asyncio.Future) and transfer.done():
                transfer.result()
            else:
                pending.append(transfer)
        state.transfers = pending

    def _fail(self, rid: str, state: _RequestState, error: Failure) -> None:
        for transfer in state.transfers:
            if isinstance(transfer, asyncio.Future):
                transfer.cancel()
        state.transfers.clear()
        for dst in self.cfg.stream_to:
            self.outbox.signal(rid, self.name, dst, state.num_emitted, error.message)
        self.outbox.complete(rid, self.name, error=error)


def failure(stage: str, error: Exception) -> Failure:
    """What the client is told when a stage's run raises: a refusal the executor passes on (a
    CadenceError with a status of its own, such as the server's engine answering 429 or a
    400 naming a field) keeps its message, status and field, so that a spoken chat is
    refused as a text chat is; anything else is the stage's failure, a 500 naming it."""
    if isinstance(error, CadenceError) and error.status != 500:
        return Failure(str(error), error.status, error.param)
    return Failure(f"stage {stage!r} failed: {type(error).__name__}: {error}")
