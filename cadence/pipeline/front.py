"""The stages placed in the front (`placement: front`): in the coordinator's own process.

A server runs a stage there when the stage needs what only the server's process has, the
server's engine client above all: the speech pipeline's thinker generates on the server's
own scheduler instead of a second engine. These stages run through the same `StageRuntime`
as every other, on the coordinator's event loop, and talk to the stage processes over the
same control plane:

    client ──(by reference)──► front stage ──DataReady (inline)──► a stage process
    a stage process ──DataReady (inline)──► the coordinator's PULL ──► front stage
    front stage ──(by reference)──► the client's stream and result

Every payload to or from the front travels inline in its control message: the front joins
no relay group, so it never waits for a credit and a stage process's restart never touches
it. An abort reaches the front stages together with the broadcast to the processes; their
runs are cancelled at once. The executors get the caller's `services` at setup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import zmq

from cadence.pipeline.config import CLIENT, FRONT, PipelineConfig, resolve
from cadence.pipeline.errors import Failure, PipelineStartError
from cadence.pipeline.executor import Executor, StageContext
from cadence.pipeline.process import PRUNE_PERIOD_S, build_executor
from cadence.pipeline.stage import StageRuntime
from cadence.pipeline.transport import Transport, _done


class ClientSide(Protocol):
    """Where the front's stages deliver to the client, by reference: the coordinator."""

    def complete(self, rid: str, stage: str, result: Any, error: Failure | None) -> None: ...

    def stream_chunk(
        self, rid: str, stage: str, chunk_id: int, data: Any, is_done: bool, error: str | None
    ) -> None: ...


logger = logging.getLogger("cadence.pipeline")


class FrontStages(Transport):
    """The front's stages and their side of the control plane (the `Outbox` of each)."""

    def __init__(
        self,
        config: PipelineConfig,
        coordinator: ClientSide,
        ctx: zmq.Context,
        process_addresses: dict[str, str],
    ):
        super().__init__(config, FRONT, None, ctx, None, process_addresses)
        self.owner = coordinator  # results and client chunks go to it by reference
        self.executors: dict[str, Executor] = {}
        self._pruner: asyncio.Task | None = None

    async def setup(self, services: Mapping[str, Any]) -> None:
        """Builds and sets up each front stage's executor; PipelineStartError naming the stage
        whose setup failed."""
        for name in self.graph.front_stages:
            cfg = self.config.stage(name)
            try:
                executor = self.executors[name] = build_executor(self.config, name)
                await executor.setup(StageContext(name, cfg.device, FRONT, services))
            except Exception as e:
                raise PipelineStartError(
                    f"stage {name} (placed in the front) failed to start: {type(e).__name__}: {e}"
                ) from e
            merge = resolve(cfg.merge) if cfg.merge else None
            self.runtimes[name] = StageRuntime(
                cfg, self.graph, executor, self, merge, self.on_finished
            )
        self._pruner = asyncio.get_running_loop().create_task(self._prune())

    def submit(self, rid: str, request: Any) -> None:
        """A new request for the entry stage, which is placed here."""
        self.runtimes[self.graph.entry].on_input(rid, CLIENT, _done(request))

    def live(self) -> dict[str, list[str]]:
        """Per front stage, the rids it holds state for."""
        return {name: list(rt.requests) for name, rt in self.runtimes.items()}

    async def aclose(self) -> None:
        """Cancels every run and closes the executors (the sockets close with `close`)."""
        if self._pruner is not None:
            self._pruner.cancel()
        for runtime in self.runtimes.values():
            for rid in list(runtime.requests):
                runtime.abort(rid)
        for name, executor in self.executors.items():
            try:
                await executor.close()
            except Exception:
                logger.exception("stage %s: closing its executor failed", name)
        self.executors.clear()

    async def _prune(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_PERIOD_S)
            self.prune_dropped()

    # -- to the client: by reference, no socket -------------------------------------------

    def complete(self, rid: str, stage: str, result: Any = None, error: Failure | None = None):
        self.owner.complete(rid, stage, result, error)

    def stream_client(
        self,
        rid: str,
        stage: str,
        chunk_id: int,
        data: Any = None,
        is_done: bool = False,
        error: str | None = None,
    ) -> None:
        self.owner.stream_chunk(rid, stage, chunk_id, data, is_done, error)
