"""How payloads leave and enter a stage process.

Out: to a colocated stage, the object itself (by reference, no copy, no message); to a stage
in another process, its tensors are extracted and either packed inline after the DataReady
message (small payloads) or put in the relay, announced by DataReady and then waited for;
to the client, Complete/Stream with the tensors inline.

In: Submit and DataReady become awaitables handed to the stage at once: a relay get is
posted as soon as its DataReady arrives (in arrival order, which NCCL pairing relies on), and
acknowledged to the sender when done. A DataReady for a request this process has dropped is
still consumed (drained and acknowledged) so that the sender's put completes; nothing is
delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch
import zmq

from cadence.pipeline import channels
from cadence.pipeline.config import CLIENT, PipelineConfig
from cadence.pipeline.messages import Complete, DataAck, DataReady, Stream, Submit
from cadence.pipeline.payload import buffer_from_frame, extract, restore
from cadence.pipeline.relay.base import Relay, RelayError
from cadence.pipeline.stage import StageRuntime

logger = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 120.0  # how long a dropped rid's late messages are recognised and drained


def _done(value: Any) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def _failed(error: BaseException) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(error)
    return future


def _quiet(task: asyncio.Future) -> None:
    """An input nobody awaits any more (its request failed) must not log 'never retrieved'."""
    if not task.cancelled():
        task.exception()


class Transport:
    """A stage process's side of both planes; the `Outbox` of every stage it hosts."""

    def __init__(
        self,
        config: PipelineConfig,
        process: str,
        relay: Relay | None,
        ctx: zmq.Context,
        coordinator_address: str,
        process_addresses: dict[str, str],
    ):
        self.config = config
        self.graph = config.graph
        self.process = process
        self.relay = relay
        self.inline_max = config.relay.inline_max_bytes
        self.timeout = config.relay.transfer_timeout_s
        self.runtimes: dict[str, StageRuntime] = {}  # the stages of this process
        self._ctx = ctx
        self._addresses = process_addresses
        self._peers: dict[str, zmq.Socket] = {}
        self.coordinator = channels.connect(ctx, zmq.PUSH, coordinator_address)
        self.dropped: dict[str, float] = {}  # rid -> when: aborted, or ended with a stream open

    # -- request life ---------------------------------------------------------------------

    def is_live(self, rid: str) -> bool:
        return rid not in self.dropped

    def drop(self, rid: str) -> None:
        """Forget `rid` here: runs cancelled, relay resources released, late messages drained."""
        self.dropped[rid] = time.monotonic()
        for runtime in self.runtimes.values():
            runtime.abort(rid)
        if self.relay is not None:
            self.relay.cleanup(rid)

    def on_finished(self, rid: str, stream_open: bool) -> None:
        if stream_open:  # chunks may still come: recognise them as late
            self.dropped[rid] = time.monotonic()

    def prune_dropped(self) -> None:
        horizon = time.monotonic() - TOMBSTONE_TTL_S
        for rid in [r for r, t in self.dropped.items() if t < horizon]:
            del self.dropped[rid]

    # -- outbound (the Outbox protocol) ---------------------------------------------------

    async def send(self, rid: str, src: str, dst: str, data: Any, chunk_id: int | None):
        local = self.runtimes.get(dst)
        if local is not None:
            if chunk_id is None:
                local.on_input(rid, src, _done(data))
            else:
                local.on_chunk(rid, src, chunk_id, _done(data), False, None)
            return None
        payload = extract(data)
        msg = DataReady(rid=rid, stage=dst, src_stage=src, payload=payload.header)
        msg.chunk_id, msg.is_done = chunk_id, chunk_id is None
        peer = self._peer(dst)
        if payload.nbytes == 0 or payload.nbytes <= self.inline_max or self.relay is None:
            frame = payload.pack("cpu").numpy() if payload.nbytes else None
            channels.send(peer, msg, frame)
            return None
        dst_rank = self.graph.rank_of(self.graph.process_of[dst])
        op = await self.relay.put_payload_async(payload, rid, dst_rank)
        msg.relay = op.metadata
        channels.send(peer, msg)  # announce before waiting: credits come back through it
        if not self.is_live(rid):  # dropped while we waited for a credit
            self.relay.cleanup(rid)
        return asyncio.get_running_loop().create_task(self._delivered(op, dst))

    async def _delivered(self, op, dst: str) -> None:
        try:
            await op.wait_for_completion(self.timeout)
        except RelayError as e:
            raise RelayError(f"sending to stage {dst!r} failed: {e}") from None

    def signal(self, rid: str, src: str, dst: str, chunk_id: int, error: str | None) -> None:
        local = self.runtimes.get(dst)
        if local is not None:
            local.on_chunk(rid, src, chunk_id, None, True, error)
            return
        msg = DataReady(rid=rid, stage=dst, src_stage=src, chunk_id=chunk_id, error=error)
        channels.send(self._peer(dst), msg)

    def complete(self, rid: str, stage: str, result: Any = None, error: str | None = None) -> None:
        msg = Complete(rid=rid, stage=stage, error=error)
        frame = None
        if error is None:
            msg.payload, frame = self._inline(result)
        channels.send(self.coordinator, msg, frame)

    def stream_client(
        self,
        rid: str,
        stage: str,
        chunk_id: int,
        data: Any = None,
        is_done: bool = False,
        error: str | None = None,
    ) -> None:
        msg = Stream(rid=rid, stage=stage, chunk_id=chunk_id, is_done=is_done, error=error)
        frame = None
        if not is_done and error is None:
            msg.payload, frame = self._inline(data)
        channels.send(self.coordinator, msg, frame)

    def _inline(self, data: Any):
        try:
            payload = extract(data)
        except TypeError as e:
            raise TypeError(f"the result cannot be sent to the client: {e}") from None
        return payload.header, payload.pack("cpu").numpy() if payload.nbytes else None

    def _peer(self, stage: str) -> zmq.Socket:
        process = self.graph.process_of[stage]
        sock = self._peers.get(process)
        if sock is None:
            sock = self._peers[process] = channels.connect(
                self._ctx, zmq.PUSH, self._addresses[process]
            )
        return sock

    # -- inbound --------------------------------------------------------------------------

    def on_submit(self, msg: Submit, frame) -> None:
        if not self.is_live(msg.rid):
            return
        try:
            value = _done(restore(msg.payload, buffer_from_frame(frame) if frame else None))
        except Exception as e:
            value = _failed(ValueError(f"the request payload does not decode: {e}"))
        self.runtimes[msg.stage].on_input(msg.rid, CLIENT, value)

    def on_data_ready(self, msg: DataReady, frame) -> None:
        live = self.is_live(msg.rid)
        value = self._fetch(msg, frame, live) if msg.payload is not None else None
        runtime = self.runtimes.get(msg.stage)
        if not live or runtime is None:
            return
        if msg.chunk_id is None:
            runtime.on_input(msg.rid, msg.src_stage, value if value is not None else _done(None))
        else:
            runtime.on_chunk(msg.rid, msg.src_stage, msg.chunk_id, value, msg.is_done, msg.error)

    def on_data_ack(self, msg: DataAck, frame) -> None:
        if self.relay is not None:
            self.relay.acknowledge(msg.relay)

    def _fetch(self, msg: DataReady, frame, live: bool):
        if msg.relay is None:
            if not live:
                return None
            try:
                return _done(restore(msg.payload, buffer_from_frame(frame) if frame else None))
            except Exception as e:
                return _failed(ValueError(f"a payload from {msg.src_stage} does not decode: {e}"))
        task = asyncio.get_running_loop().create_task(self._get(msg, live))
        task.add_done_callback(_quiet)
        return task

    async def _get(self, msg: DataReady, live: bool) -> Any:
        relay, meta = self.relay, msg.relay
        src_process = self.graph.process_of[msg.src_stage]
        try:
            if not live:
                await relay.discard_async(meta, msg.rid, self.graph.rank_of(src_process))
                return None
            device = relay.buffer_device(self.graph.rank_of(src_process))
            dest = torch.empty(meta["size"], dtype=torch.uint8, device=device)
            op = await relay.get_async(meta, dest, msg.rid)
            await op.wait_for_completion(self.timeout)
        except RelayError as e:
            raise RelayError(f"receiving from stage {msg.src_stage!r} failed: {e}") from None
        finally:
            if relay.needs_ack:
                sock = self._peer(msg.src_stage)
                channels.send(sock, DataAck(rid=msg.rid, relay=meta))
        return restore(msg.payload, dest)

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self.coordinator.close(linger=0)
