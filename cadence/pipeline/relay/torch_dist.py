"""`torch`: torch.distributed point-to-point between the pipeline's stage processes.

One process group per pipeline: every stage process is a rank (its number in the graph's
process list), joined through a TCP store on localhost at a port the launcher picked. A put
is an `isend` tagged with a fresh number, announced in DataReady as {src, tag, size}; the
receiver posts the matching `irecv`. Between two CUDA processes the transfer is NCCL on the
GPU (NCCL ignores tags: it pairs sends and receives in posting order, which holds because a
receiver posts its receives in the order the sender's DataReady messages arrive, and one
sender's messages to one receiver arrive in order); any other pair goes through gloo on CPU.

What this backend cannot do: cancel a posted send (cleanup only stops waiting for it; the
receiver still drains it, as every receiver does), or replace one member of the group: after
a stage process dies the whole pipeline is restarted (or the server exits).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from cadence.pipeline.relay.base import (
    Relay,
    RelayAborted,
    RelayContext,
    RelayError,
    RelayOperation,
    RelayTimeout,
    register_relay,
)

_MAX_TAG = 1 << 30
_MAX_POLL_S = 0.001
WAIT_THREADS = 16


class _WorkOp(RelayOperation):
    """A posted isend/irecv, watched from the moment it is posted until its work completes.

    A gloo work completes only inside `wait()`, which blocks: it runs on the relay's own
    threads (a wait is short, since the peer posts the matching operation as soon as the
    DataReady arrives). An NCCL work is polled (`is_completed` reads its CUDA event), so no
    thread waits on a GPU. The op (and its tensor) stays referenced until then even after
    `cleanup`: dropping a pending work cancels it, and its peer would wait forever."""

    def __init__(self, relay: TorchRelay, rid: str, meta: dict[str, Any], work, tensor):
        self.relay, self.rid, self.meta = relay, rid, meta
        self.work, self.tensor = work, tensor  # the tensor lives until the work is done
        loop = asyncio.get_running_loop()
        self.aborted = loop.create_future()
        if tensor.is_cuda:
            self.done = asyncio.ensure_future(self._poll())
        else:
            self.done = loop.run_in_executor(relay.waiters, self._wait)
        self.done.add_done_callback(self._finished)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.meta

    async def wait_for_completion(self, timeout: float | None = None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait({self.done, self.aborted}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise self._timeout(timeout) from None
        if not self.done.done():
            raise RelayAborted(f"request {self.rid} was cleaned up")
        self.done.result()

    def _finished(self, done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: after a cleanup nobody waits for it
        self.relay._forget(self)

    def _wait(self) -> None:
        # No timeout here: gloo closes a pair whose wait times out, which would break every
        # later transfer between the two processes. The caller's timeout stops waiting; the
        # thread returns when the peer drains the transfer (it always does) or dies.
        try:
            self.work.wait()
        except RuntimeError as e:
            raise RelayError(f"torch.distributed transfer failed: {e}") from None

    async def _poll(self) -> None:
        delay = 0.0
        while not self.work.is_completed():
            await asyncio.sleep(delay)
            delay = min(_MAX_POLL_S, delay * 2 or 20e-6)
        self.work.wait()

    def _timeout(self, timeout: float | None) -> RelayTimeout:
        return RelayTimeout(
            f"torch.distributed transfer with rank {self.meta['peer']} did not complete "
            f"in {timeout} s"
        )


@register_relay("torch")
class TorchRelay(Relay):
    """Point-to-point over a process group; see the module docstring."""

    can_replace_process = False

    def __init__(self, ctx: RelayContext):
        super().__init__(ctx)
        if ctx.store_address is None:
            raise RelayError("the torch relay needs a store address (the launcher gives one)")
        self.devices = ctx.peer_devices or (ctx.device,) * ctx.world_size
        is_cuda = [d.startswith("cuda") for d in self.devices]
        if any(is_cuda):
            if not torch.cuda.is_available():
                raise RelayError("a stage is on CUDA but this machine has no CUDA device")
            backend = "cpu:gloo,cuda:nccl"
            if is_cuda[ctx.rank]:
                torch.cuda.set_device(torch.device(ctx.device))
        else:
            backend = "gloo"
        self.transport = backend
        dist.init_process_group(
            backend,
            init_method=f"tcp://{ctx.store_address}",
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=datetime.timedelta(seconds=max(600.0, 10 * ctx.config.transfer_timeout_s)),
        )
        self._tags = itertools.count(1)
        self._ops: dict[str, set[_WorkOp]] = {}
        self.waiters = ThreadPoolExecutor(WAIT_THREADS, thread_name_prefix="relay-wait")

    def buffer_device(self, peer: int) -> torch.device:
        both_cuda = self.devices[peer].startswith("cuda") and self.ctx.device.startswith("cuda")
        return torch.device(self.ctx.device) if both_cuda else torch.device("cpu")

    async def put_async(self, tensor: torch.Tensor, request_id: str, dst: int) -> RelayOperation:
        tensor = tensor.to(self.buffer_device(dst))
        tag = next(self._tags) % _MAX_TAG
        work = dist.isend(tensor, dst=dst, tag=tag)
        meta = {"src": self.ctx.rank, "peer": dst, "tag": tag, "size": tensor.numel()}
        return self._track(_WorkOp(self, request_id, meta, work, tensor))

    async def get_async(
        self, metadata: dict[str, Any], dest: torch.Tensor, request_id: str
    ) -> RelayOperation:
        size = metadata["size"]
        if dest.numel() < size:
            raise RelayError(f"receive buffer of {dest.numel()} bytes for a {size}-byte payload")
        target = dest[:size]
        work = dist.irecv(target, src=metadata["src"], tag=metadata["tag"])
        meta = {**metadata, "peer": metadata["src"]}
        return self._track(_WorkOp(self, request_id, meta, work, target))

    def _track(self, op: _WorkOp) -> _WorkOp:
        self._ops.setdefault(op.rid, set()).add(op)
        return op

    def _forget(self, op: _WorkOp) -> None:
        ops = self._ops.get(op.rid)
        if ops is not None:
            ops.discard(op)
            if not ops:
                del self._ops[op.rid]

    def cleanup(self, request_id: str) -> None:
        """Ends the request's waits at once; its posted works stay watched until they
        complete (the peer drains every transfer), then are forgotten."""
        for op in self._ops.get(request_id, ()):
            if not op.aborted.done():
                op.aborted.set_result(None)

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "transport": self.transport,
            "pending": sum(len(ops) for ops in self._ops.values()),  # posted, not completed
            "rids": len(self._ops),
        }

    def close(self) -> None:
        self._ops.clear()
        self.waiters.shutdown(wait=False, cancel_futures=True)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone: the process is exiting anyway
                pass
