"""`LocalPipeline`: the whole graph in the calling process and event loop.

Every stage is colocated: payloads and chunks pass by reference, with no socket, relay or
message in between, through the same `StageRuntime` the stage processes use. It is the
reference a multi-process pipeline's outputs are checked against, and a way to run a small
pipeline without processes. Placements are moot here; every executor gets `services`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cadence.pipeline.client import PipelineClient, RequestTracker
from cadence.pipeline.config import CLIENT, PipelineConfig, resolve
from cadence.pipeline.errors import Failure
from cadence.pipeline.executor import Executor, StageContext
from cadence.pipeline.process import build_executor
from cadence.pipeline.stage import StageRuntime
from cadence.pipeline.transport import _done


class LocalPipeline(PipelineClient):
    """submit / stream / abort with every stage in this process; see the module docstring."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.graph = config.graph
        self.tracker = RequestTracker(self.graph)
        self.executors: dict[str, Executor] = {}
        self.runtimes: dict[str, StageRuntime] = {}

    @classmethod
    async def start(
        cls, config: PipelineConfig, services: Mapping[str, Any] | None = None
    ) -> LocalPipeline:
        pipeline = cls(config)
        for name, cfg in pipeline.graph.stages.items():
            executor = pipeline.executors[name] = build_executor(config, name)
            await executor.setup(StageContext(name, cfg.device, "local", services or {}))
            merge = resolve(cfg.merge) if cfg.merge else None
            pipeline.runtimes[name] = StageRuntime(cfg, pipeline.graph, executor, pipeline, merge)
        return pipeline

    async def close(self) -> None:
        for runtime in self.runtimes.values():
            for rid in list(runtime.requests):
                runtime.abort(rid)
        for executor in self.executors.values():
            await executor.close()

    def live(self) -> dict[str, list[str]]:
        """Per stage, the (wire) rids it holds state for (empty once everything has ended)."""
        return {name: list(rt.requests) for name, rt in self.runtimes.items()}

    # -- PipelineClient -------------------------------------------------------------------

    def _send(self, wire: str, request: Any) -> None:
        self.runtimes[self.graph.entry].on_input(wire, CLIENT, _done(request))

    def _abort_everywhere(self, rids: list[str], reason: str) -> None:
        for rid in rids:
            for runtime in self.runtimes.values():
                runtime.abort(rid)

    # -- Outbox (every stage's) -----------------------------------------------------------

    async def send(self, rid: str, src: str, dst: str, data: Any, chunk_id: int | None):
        if chunk_id is None:
            self.runtimes[dst].on_input(rid, src, _done(data))
        else:
            self.runtimes[dst].on_chunk(rid, src, chunk_id, _done(data), False, None)
        return None

    def signal(self, rid: str, src: str, dst: str, chunk_id: int, error: str | None) -> None:
        self.runtimes[dst].on_chunk(rid, src, chunk_id, None, True, error)

    def complete(self, rid: str, stage: str, result: Any = None, error: Failure | None = None):
        if self.tracker.complete(rid, stage, result, error):
            self._abort_everywhere([rid], f"stage {stage} failed")

    def stream_client(
        self,
        rid: str,
        stage: str,
        chunk_id: int,
        data: Any = None,
        is_done: bool = False,
        error: str | None = None,
    ) -> None:
        if self.tracker.chunk(rid, stage, chunk_id, data, is_done, error):
            self._abort_everywhere([rid], f"stage {stage} failed")
