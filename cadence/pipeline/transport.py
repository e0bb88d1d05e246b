"""How payloads leave and enter a stage process.

Out: to a colocated stage, the object itself (by reference, no copy, no message); to a stage
in another process, its tensors are extracted and either packed inline after the DataReady
message (small payloads) or put in the relay, announced by DataReady and then waited for;
to the client, Complete/Stream with the tensors inline.

In: Submit and DataReady become awaitables handed to the stage at once: a relay get is
posted as soon as its DataReady arrives (in arrival order, which NCCL pairing relies on), and
acknowledged to the sender when done. A put the relay lends (shm, large payloads) is read in
place: acknowledged at once as taken, and again when the last tensor restored from it dies.
Tensors caught in a reference cycle (an aborted task's traceback, say) die only when the
garbage collector runs: once a request has ended here with lent payloads still alive, a
collection runs shortly after, and again every LENT_GC_PERIOD_S while they live on (up to
LENT_GC_TRIES times: what survives that is held on purpose), so that no credit waits for
the collector's own schedule. A DataReady for a request this process has dropped is
still consumed (drained and acknowledged) so that the sender's put completes; nothing is
delivered.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import time
from typing import Any

import torch
import zmq

from cadence.pipeline import channels
from cadence.pipeline.config import CLIENT, FRONT, PipelineConfig
from cadence.pipeline.errors import Failure
from cadence.pipeline.messages import Complete, DataAck, DataReady, Stream, Submit
from cadence.pipeline.payload import buffer_from_frame, extract, restore
from cadence.pipeline.relay.base import Relay, RelayError
from cadence.pipeline.stage import StageRuntime

logger = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 120.0  # how long a dropped rid's late messages are recognised and drained
LENT_GC_PERIOD_S = 0.2  # at most one collection this often, for lent payloads of ended requests
LENT_GC_TRIES = 10  # collections per ended request while its lent payloads live on (2 s)


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
        coordinator_address: str | None,
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
        # None in the front, whose stages hand their results to the coordinator directly.
        self.coordinator = (
            channels.connect(ctx, zmq.PUSH, coordinator_address) if coordinator_address else None
        )
        self.dropped: dict[str, float] = {}  # rid -> when: aborted, or ended with a stream open
        self._closed = False
        self._lent: dict[str, int] = {}  # rid -> lent payloads of it still alive here
        self._gc_at = 0.0  # when a collection for lent payloads ran or is due
        self._gc_handle: asyncio.TimerHandle | None = None
        self._gc_tries: dict[str, int] = {}  # ended rid -> collections run for its payloads

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
        if rid in self._lent:
            self._collect_soon()

    def on_finished(self, rid: str, stream_open: bool) -> None:
        if stream_open:  # chunks may still come: recognise them as late
            self.dropped[rid] = time.monotonic()
        if rid in self._lent:
            self._collect_soon()

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
        if (
            payload.nbytes <= self.inline_max
            or self.relay is None
            or self.graph.process_of[dst] == FRONT  # the front joins no relay
        ):
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

    def complete(self, rid: str, stage: str, result: Any = None, error: Failure | None = None):
        msg = Complete(rid=rid, stage=stage)
        if error is not None:
            msg.error, msg.status, msg.param = error.message, error.status, error.param
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
        if live and meta.get("lend"):
            return self._borrow(msg)
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

    def _borrow(self, msg: DataReady) -> Any:
        """The payload restored over the sender's memory: DataAck with our pid now (taken),
        DataAck again once no tensor of it is left (released)."""
        meta, loop = msg.relay, asyncio.get_running_loop()
        release = functools.partial(self._released, loop, msg.src_stage, msg.rid, meta)
        self._lent[msg.rid] = self._lent.get(msg.rid, 0) + 1
        try:
            buf = self.relay.lend(meta, release)
        except RelayError as e:
            self._returned(msg.src_stage, msg.rid, meta)
            raise RelayError(f"receiving from stage {msg.src_stage!r} failed: {e}") from None
        if buf is None:  # not lent after all: the sender's slot is free to go
            self._returned(msg.src_stage, msg.rid, meta)
            raise RelayError(f"stage {msg.src_stage!r} lent a payload that cannot be read")
        self._ack(msg.src_stage, msg.rid, {**meta, "borrower": os.getpid()})
        error = None
        try:
            return restore(msg.payload, buf)
        except Exception as e:
            error = f"a payload from {msg.src_stage} does not decode: {e}"
        buf = None  # out of the traceback too: the release must not wait for it
        raise ValueError(error)

    def _released(self, loop: asyncio.AbstractEventLoop, src_stage: str, rid: str, meta) -> None:
        """Runs on whichever thread dropped the last view of a lent payload."""
        try:
            loop.call_soon_threadsafe(self._returned, src_stage, rid, meta)
        except RuntimeError:
            pass  # the loop is closed: this process is ending; the sender takes its slot back

    def _returned(self, src_stage: str, rid: str, meta: dict) -> None:
        count = self._lent.pop(rid, 0) - 1
        if count > 0:
            self._lent[rid] = count
        else:
            self._gc_tries.pop(rid, None)
        self._ack(src_stage, rid, meta)

    def _collect_soon(self) -> None:
        if self._gc_handle is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._gc_at = max(self._gc_at, loop.time())
        self._gc_handle = loop.call_at(self._gc_at, self._collect)

    def _collect(self) -> None:
        """Lent payloads of requests that ended here are garbage unless a cycle holds them:
        collect, so that their acknowledgements go out."""
        self._gc_handle = None
        running = {rid for rt in self.runtimes.values() for rid in rt.requests}
        tries = self._gc_tries
        ended = [r for r in self._lent if r not in running and tries.get(r, 0) < LENT_GC_TRIES]
        if not ended:
            return
        gc.collect()
        self._gc_at = asyncio.get_running_loop().time() + LENT_GC_PERIOD_S
        # A cycle may form only as the request's last task unwinds, after this collection:
        # look again a few times; what is still alive then is held on purpose.
        for rid in ended:
            tries[rid] = tries.get(rid, 0) + 1
        if any(rid in self._lent for rid in ended):
            self._collect_soon()

    def _ack(self, src_stage: str, rid: str, meta: dict) -> None:
        if not self._closed:
            channels.send(self._peer(src_stage), DataAck(rid=rid, relay=meta))

    def close(self) -> None:
        self._closed = True
        if self._gc_handle is not None:
            self._gc_handle.cancel()
        for sock in self._peers.values():
            sock.close(linger=0)
        if self.coordinator is not None:
            self.coordinator.close(linger=0)
