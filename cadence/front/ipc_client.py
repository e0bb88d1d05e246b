"""The front process's `EngineClient`: a `FrontClient` whose messages travel over ZMQ.

Requests and control messages go to the scheduler; text outputs and control answers come
back on this front's own address (`http_worker_ipc`), read by one task on the event loop.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from cadence import io_struct
from cadence.front.client import FrontClient
from cadence.front.engine_client import ModelInfo
from cadence.front.request_checks import RequestOptions
from cadence.front.tokenizer import FrontTokenizer
from cadence.ipc import IpcPaths

logger = logging.getLogger(__name__)


class IpcEngineClient(FrontClient):
    def __init__(
        self,
        paths: IpcPaths,
        info: ModelInfo,
        tokenizer: FrontTokenizer,
        max_pending: int,
        index: int = 0,
        request_timeout_s: float | None = None,
        options: RequestOptions | None = None,
    ):
        address = paths.front_address(index)
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(address)
        # Sending never waits (PUSH with a large queue), so a plain socket serves the loop.
        self._sync_ctx = zmq.Context(1)
        self.to_scheduler = self._sync_ctx.socket(zmq.PUSH)
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.connect(paths.scheduler_input)
        super().__init__(
            tokenizer, info, self._push, max_pending, address, request_timeout_s, options
        )
        self._task: asyncio.Task[None] | None = None

    def _push(self, msg) -> None:
        self.to_scheduler.send(io_struct.encode(msg), copy=False)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            data = await self.inbox.recv(copy=False)
            try:
                self.on_message(io_struct.decode(data.bytes))
            except Exception:  # one bad message must not stop every request's results
                logger.exception(
                    "a message from the scheduler side could not be taken (%d bytes)",
                    len(data.bytes),
                )

    def close(self) -> None:
        self.is_closed = True
        if self._task:
            self._task.cancel()
        self.ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
