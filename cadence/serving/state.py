"""What both adapters of one front process share: the arguments, the engine client, the
server's life (loading, ready, stopping)."""

from __future__ import annotations

import dataclasses
import time

from cadence.front.engine_client import EngineClient
from cadence.server_args import ServerArgs


@dataclasses.dataclass
class ServerState:
    """`client` is None until the model is loaded."""

    args: ServerArgs
    client: EngineClient | None = None
    runtime: dict = dataclasses.field(default_factory=dict)  # facts the scheduler reported
    is_ready: bool = False  # loaded and warmed up
    is_shutting_down: bool = False
    started: float = dataclasses.field(default_factory=time.time)
    chat_template: str | None = None  # the --chat-template text, read at start-up
