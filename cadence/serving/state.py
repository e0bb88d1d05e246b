"""What both adapters of one front process share: the arguments, the engine client, the
server's life (loading, ready, stopping) and its one readiness gate, the serving objects,
and the stage pipeline of --pipeline."""

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
    # The serving objects both adapters answer through, built once: a `bundle.Serving`, read
    # through `bundle.serving_of` (typed there: the bundle is built on this state, not under).
    serving: object | None = None

    def check_ready(self, while_loading: bool = False, hint: str = "") -> None:
        """The one readiness gate of both protocols: RequestError 503 while the server stops,
        or (unless `while_loading`) while the model loads; `hint` ends the starting message
        with how this protocol's clients learn when to retry."""
        if self.is_shutting_down:
            raise RequestError(503, "the server is shutting down")
        if not while_loading and not self.is_ready:  # ready: the client is connected
            raise RequestError(503, f"the server is starting: the model is loading{hint}")

    def health_problem(self) -> str | None:
        """Why a health check fails now (stopping, starting, a pipeline stage down); None
        when the server serves."""
        if self.is_shutting_down:
            return "shutting down"
        if not self.is_ready:
            return "starting"
        return self.pipeline_problem

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
