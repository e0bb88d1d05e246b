"""The executor seam: what a stage runs for each request.

A stage's `executor` factory returns an `Executor`. Its process calls `setup` once before it
reports ready, `run` once per request (concurrently for different requests, each in its own
asyncio task, on the process's one event loop), and `close` at shutdown. A long computation
belongs in a thread (`asyncio.to_thread`) or on a device stream, so that the loop keeps
moving other requests' messages.

    class Scale(Executor):
        def __init__(self, factor: float):
            self.factor = factor

        async def run(self, req: StageRequest):
            y = req.data["x"] * self.factor
            await req.emit({"x": y})   # a chunk to the stream edges, if any
            return {"x": y}            # the result, to `next` / the client
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cadence.pipeline.config import FRONT


class StreamError(RuntimeError):
    """The stage streaming into this one failed; raised by the stream's iterator."""


@dataclass(frozen=True)
class StageContext:
    """What an executor learns about its stage at setup."""

    name: str
    device: str
    process: str  # the process it shares with its colocated stages; "local": LocalPipeline's
    services: Mapping[str, Any] = field(default_factory=dict)
    """What the process hosting the pipeline hands its in-process stages (those placed in the
    front, and every stage of a LocalPipeline), by name: `Pipeline.start(services=...)`. A
    Cadence server hands "engine_client", an awaitable of its EngineClient that resolves
    once the model is loaded. Stage processes get none: services do not cross processes."""

    @property
    def has_own_process(self) -> bool:
        """The stage runs in a stage process, not in the caller's (front or local): settings
        of the whole process (thread counts, signal handlers) are then the stage's to make."""
        return self.process not in ("local", FRONT)


class ChunkStream:
    """The chunks a stream edge delivers to one request, in order, as an async iterator.

    Ends when the producer's run ends; raises StreamError if the producer failed. Chunks from
    a stage in the same process are the producer's own objects: read-only by contract."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self.is_closed = False  # the end (or the error) has arrived, read or not

    def push(self, value: Awaitable) -> None:
        self._queue.put_nowait(("chunk", value))

    def close(self, error: str | None = None) -> None:
        if not self.is_closed:
            self.is_closed = True
            self._queue.put_nowait(("error", error) if error else ("end", None))

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> Any:
        kind, value = await self._queue.get()
        if kind == "chunk":
            return await asyncio.shield(value)  # cancelling the reader leaves the get running
        self._queue.put_nowait((kind, value))  # iterating again ends (or fails) again
        if kind == "error":
            raise StreamError(value)
        raise StopAsyncIteration


class StageRequest:
    """One request as a stage sees it.

    `data` is the stage's input: the request (entry stage), the upstream stage's result, or
    the merge function's output (fan-in); None for a stage fed by a stream only. Objects that
    came by reference from a colocated stage are read-only: copy before changing them."""

    def __init__(
        self,
        rid: str,
        stage: str,
        data: Any,
        stream: ChunkStream | None,
        emit: Callable[[Any], Awaitable[None]],
    ):
        self.rid = rid
        self.stage = stage
        self.data = data
        self.stream = stream
        self._emit = emit

    async def emit(self, chunk: Any) -> None:
        """Sends one chunk to this stage's stream edges (and the client, with
        stream_to_client), before the run ends; waits when the relay has no credit left. The
        chunk must not be changed afterwards."""
        await self._emit(chunk)


class Executor(ABC):
    """A stage's work.

    Invariants: `run` may be called again before an earlier call returns (different rids);
    it is cancelled (asyncio.CancelledError at an await) when its request is aborted, and must
    leave nothing behind that outlives the call but what it deliberately caches. An exception
    from `run` fails that request only: the client gets it, naming the stage."""

    async def setup(self, ctx: StageContext) -> None:
        """Load models, allocate buffers; runs once, before the stage reports ready."""

    @abstractmethod
    async def run(self, req: StageRequest) -> Any:
        """The result for `req` (plain data and tensors; see payload.py)."""

    async def close(self) -> None:
        """Release what setup took; runs once, at shutdown."""
