"""What both adapters of one front process share: the arguments, the engine client, the
server's life (loading, ready, stopping), and the stage pipeline of --pipeline."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from cadence.errors import RequestError
from cadence.front.engine_client import EngineClient
from cadence.server_args import ServerArgs

if TYPE_CHECKING:
    from cadence.pipeline import Pipeline, PipelineClient


@dataclasses.dataclass
class ServerState:
    """`client` is None until the model is loaded; `pipeline` until every stage is ready."""

    args: ServerArgs
    client: EngineClient | None = None
    runtime: dict = dataclasses.field(default_factory=dict)  # facts the scheduler reported
    is_ready: bool = False  # loaded and warmed up
    is_shutting_down: bool = False
    started: float = dataclasses.field(default_factory=time.time)
    chat_template: str | None = None  # the --chat-template text, read at start-up
    pipeline: Pipeline | None = None  # --pipeline's stages, started by this front process

    @property
    def pipeline_problem(self) -> str | None:
        """Why --pipeline's stages cannot serve now (starting, a stage process down or
        restarting); None when they can, or when the server runs no pipeline."""
        if self.args.pipeline is None:
            return None
        if self.pipeline is None:
            return "the pipeline is starting"
        return self.pipeline.coordinator.unhealthy_reason

    def pipeline_client(self) -> PipelineClient:
        """The coordinator of --pipeline: `submit(request)`, `stream(request)`, `abort(rid)`
        (see cadence.pipeline.client). A 400 naming the flag when this server runs no
        pipeline, a 503 while it starts; a stage down fails the call itself with 503."""
        if self.args.pipeline is None:
            raise RequestError(400, "this server runs no stage pipeline; start it with --pipeline")
        if self.pipeline is None:
            raise RequestError(503, "the pipeline is starting")
        return self.pipeline.coordinator
