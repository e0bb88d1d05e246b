"""The front process's link to the scheduler and detokenizer processes over ZMQ.

Wraps one `TokenizerManager` (all request logic) with the sockets: requests and control
messages go to the scheduler; text outputs and control answers come back on this front's
own address (`http_worker_ipc`), read by one task on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque

import zmq
import zmq.asyncio

from cadence import io_struct
from cadence.io_struct import (AbortReq, BatchStrOutput, ContinueGenerationReqInput, FlushCacheReqInput, FlushCacheReqOutput,
                               GetLoadReqInput, GetLoadReqOutput, PauseGenerationReqInput, ProfileReq,
                               ProfileReqOutput, UpdateWeightFromDiskReqInput, UpdateWeightFromDiskReqOutput)
from cadence.ipc import IpcPaths
from cadence.tokenizer_manager import ModelInfo, RequestError, TokenizerManager

logger = logging.getLogger(__name__)

_REPLY_TYPES = {
    FlushCacheReqInput: FlushCacheReqOutput,
    GetLoadReqInput: GetLoadReqOutput,
    ProfileReq: ProfileReqOutput,
    UpdateWeightFromDiskReqInput: UpdateWeightFromDiskReqOutput,
}


class EngineClient:
    def __init__(self, paths: IpcPaths, info: ModelInfo, tokenizer, max_pending: int, index: int = 0,
                 request_timeout_s: float | None = None):
        self.address = paths.front_address(index)
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(self.address)
        # Sending never waits (PUSH with a large queue), so a plain socket serves the loop.
        self._sync_ctx = zmq.Context(1)
        self.to_scheduler = self._sync_ctx.socket(zmq.PUSH)
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.connect(paths.scheduler_input)
        self.tm = TokenizerManager(tokenizer, info, self.send, max_pending=max_pending, worker_ipc=self.address,
                                   request_timeout_s=request_timeout_s)
        self._waiters: dict[type, deque[asyncio.Future]] = defaultdict(deque)
        self._control_lock: dict[type, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._task: asyncio.Task | None = None
        self.is_paused = False  # PauseGeneration sent by this front and not yet continued
        self.is_closed = False

    def send(self, msg) -> None:
        if self.is_closed:  # shutting down: a late abort from a request's cleanup has nowhere to go
            return
        self.to_scheduler.send(io_struct.encode(msg), copy=False)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            data = await self.inbox.recv(copy=False)
            msg = io_struct.decode(data.bytes)
            if isinstance(msg, BatchStrOutput):
                self.tm.handle_output(msg)
                continue
            waiters = self._waiters.get(type(msg))
            if waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(msg)
            else:
                logger.warning("unexpected %s from the scheduler", type(msg).__name__)

    async def control(self, req, timeout: float = 60.0):
        """Sends a control request and waits for its answer (one at a time per kind)."""
        reply_type = _REPLY_TYPES[type(req)]
        async with self._control_lock[reply_type]:
            fut = asyncio.get_running_loop().create_future()
            self._waiters[reply_type].append(fut)
            req.http_worker_ipc = self.address
            self.send(req)
            try:
                return await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                self._waiters[reply_type].remove(fut)
                raise RequestError(503, f"the scheduler did not answer {type(req).__name__} in {timeout:.0f}s")

    async def get_load(self) -> GetLoadReqOutput:
        return await self.control(GetLoadReqInput())

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self.control(FlushCacheReqInput())

    def pause(self, mode: str) -> None:
        self.send(PauseGenerationReqInput(mode=mode, http_worker_ipc=self.address))
        self.is_paused = True

    def resume(self) -> None:
        self.send(ContinueGenerationReqInput(http_worker_ipc=self.address))
        self.is_paused = False

    async def profile(self, action: str, output_dir: str | None, num_steps: int | None = None) -> ProfileReqOutput:
        return await self.control(ProfileReq(action=action, output_dir=output_dir, num_steps=num_steps))

    async def update_weights(self, model_path: str, load_format: str | None) -> UpdateWeightFromDiskReqOutput:
        return await self.control(UpdateWeightFromDiskReqInput(model_path=model_path, load_format=load_format),
                                  timeout=600)

    def end_all(self, message: str, status: int = 503) -> None:
        """Ends every request of this front now with an error of `status`, without waiting for
        the scheduler (the server is stopping, or a child died and will never answer)."""
        rids = list(self.tm.states)
        if not rids:
            return
        self.send(AbortReq(abort_all=True, message=message, http_worker_ipc=self.address))
        n = len(rids)
        # The token counts are never shown: a finish reason with status >= 400 becomes an error.
        self.tm.handle_output(BatchStrOutput(
            rids=rids, http_worker_ipcs=[self.address] * n, output_strs=[""] * n, output_ids=[[] for _ in rids],
            finished_reasons=[{"type": "abort", "message": message, "status_code": status} for _ in rids],
            prompt_tokens=[0] * n, completion_tokens=[0] * n, cached_tokens=[0] * n))

    def close(self) -> None:
        self.is_closed = True
        if self._task:
            self._task.cancel()
        self.ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
