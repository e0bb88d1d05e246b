"""`shm`: host shared memory between processes of one machine.

Each process owns one pool segment, `/dev/shm/cadence-relay-<pid>-<pipeline>-pool`, cut in
`credits` slots of `slot_mb` MiB. A put takes a slot (waiting for one if none is free: that is
the credit), copies the packed payload in and returns metadata naming the segment, offset
and size; the receiver copies it out and sends DataAck, which frees the slot. A payload
larger than a slot gets a segment of its own (`...-d<seq>`, still one credit), unlinked when
acknowledged. A slot is also freed by `cleanup(request_id)` and by `close()`.

Every name carries the owner's pid, so whatever a killed process leaves behind is found and
removed by `sweep_dead_segments()`, which every relay runs when it starts (and the launcher
after a stage process dies). Linux only: segments are files under /dev/shm, mapped with mmap
(no multiprocessing.shared_memory, whose resource tracker would unlink segments it does not
own when a reader exits).
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence.pipeline.lifecycle import is_alive
from cadence.pipeline.payload import Extracted, copy_bytes
from cadence.pipeline.relay.base import (
    Relay,
    RelayAborted,
    RelayContext,
    RelayError,
    RelayOperation,
    RelayTimeout,
    register_relay,
)

SHM_DIR = "/dev/shm"
PREFIX = "cadence-relay-"
THREAD_COPY_BYTES = 1 << 20  # larger copies run off the event loop (torch releases the GIL)


def segment_name(pid: int, pipeline_id: str, suffix: str) -> str:
    return f"{PREFIX}{pid}-{pipeline_id}-{suffix}"


def owner_pid(name: str) -> int | None:
    pid = name[len(PREFIX) :].split("-", 1)[0] if name.startswith(PREFIX) else ""
    return int(pid) if pid.isdigit() else None


def list_segments(root: str = SHM_DIR) -> list[str]:
    """Names of every relay segment in `root` (any owner pid)."""
    try:
        return sorted(n for n in os.listdir(root) if n.startswith(PREFIX))
    except OSError:
        return []


def sweep_dead_segments(root: str = SHM_DIR, pids: set[int] | None = None) -> list[str]:
    """Unlinks our user's relay segments whose owner pid is dead (only those of `pids` when
    given); returns their names."""
    removed = []
    for name in list_segments(root):
        pid = owner_pid(name)
        if pid is None or (pids is not None and pid not in pids):
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or is_alive(pid):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


class Segment:
    """One mapped /dev/shm file, as a 1-D uint8 tensor over its whole size."""

    def __init__(self, name: str, size: int, create: bool):
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            raise RelayError(f"shared memory segment {name} is gone (its sender died?)") from None
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size) if size else None
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(path)
            raise
        os.close(fd)
        self.name, self.path, self.size = name, path, size
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8) if self.mm else None

    def close(self) -> None:
        self.tensor = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
            self.mm = None

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass
class _Held:
    """A put whose slot is not free yet."""

    rid: str
    slot: int
    future: asyncio.Future
    dedicated: Segment | None = None


@dataclass
class _PutOp(RelayOperation):
    meta: dict[str, Any]
    future: asyncio.Future = field(repr=False)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.meta

    async def wait_for_completion(self, timeout: float | None = None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self.future)
        except TimeoutError:
            raise RelayTimeout(
                f"the receiver did not read shared memory {self.meta['segment']} in {timeout} s"
            ) from None


class _DoneOp(RelayOperation):
    def __init__(self, meta: dict[str, Any]):
        self.meta = meta

    @property
    def metadata(self) -> dict[str, Any]:
        return self.meta

    async def wait_for_completion(self, timeout: float | None = None) -> None:
        return None


@register_relay("shm")
class ShmRelay(Relay):
    """Shared-memory slots with credits; see the module docstring for the life of a slot."""

    needs_ack = True

    def __init__(self, ctx: RelayContext):
        super().__init__(ctx)
        sweep_dead_segments()
        self.pid = os.getpid()
        self.slot_bytes = _round_up(ctx.config.slot_bytes, 4096)
        self.credits = ctx.config.credits
        self.timeout = ctx.config.transfer_timeout_s
        self.pool = Segment(
            segment_name(self.pid, ctx.pipeline_id, "pool"), self.slot_bytes * self.credits, True
        )
        self._free: list[int] = list(range(self.credits - 1, -1, -1))
        self._waiters: deque[asyncio.Future] = deque()
        self._held: dict[int, _Held] = {}  # seq -> held put
        self._by_rid: dict[str, set[int]] = {}
        self._copying = 0  # slots taken by puts still copying in
        self._seq = itertools.count(1)
        self._attached: dict[str, Segment] = {}  # other processes' pools, mapped once

    # -- sender side ---------------------------------------------------------------------

    async def put_async(self, tensor: torch.Tensor, request_id: str, dst: int) -> RelayOperation:
        return await self._put(
            tensor.numel(), lambda region: copy_bytes(region, tensor), request_id
        )

    async def put_payload_async(
        self, payload: Extracted, request_id: str, dst: int
    ) -> RelayOperation:
        return await self._put(payload.nbytes, payload.pack_into, request_id)

    async def _put(self, nbytes: int, fill, rid: str) -> RelayOperation:
        slot = await self._acquire()
        seq = next(self._seq)
        dedicated = None
        try:
            if nbytes > self.slot_bytes:
                name = segment_name(self.pid, self.ctx.pipeline_id, f"d{seq}")
                dedicated = Segment(name, nbytes, create=True)
                region, offset = dedicated.tensor, 0
            else:
                offset = slot * self.slot_bytes
                region = self.pool.tensor[offset : offset + nbytes]
        except BaseException:
            self._release_slot(slot)
            raise
        self._copying += 1
        copied = self._copy(lambda: fill(region), nbytes)
        try:
            await asyncio.shield(copied)
        except BaseException:
            # Cancelled (or failed) while a thread may still write: free it once that is over.
            copied.add_done_callback(lambda _: self._abandon(slot, dedicated))
            raise
        self._copying -= 1
        future = asyncio.get_running_loop().create_future()
        self._held[seq] = _Held(rid, slot, future, dedicated)
        self._by_rid.setdefault(rid, set()).add(seq)
        segment = dedicated.name if dedicated else self.pool.name
        meta = {"segment": segment, "offset": offset, "size": nbytes, "seq": seq, "pid": self.pid}
        return _PutOp(meta, future)

    def acknowledge(self, metadata: dict[str, Any]) -> None:
        if metadata.get("pid") == self.pid:
            self._finish(metadata.get("seq"), None)

    def cleanup(self, request_id: str) -> None:
        for seq in self._by_rid.pop(request_id, ()):
            self._finish(seq, RelayAborted(f"request {request_id} was cleaned up"))

    def _finish(self, seq: Any, error: Exception | None) -> None:
        held = self._held.pop(seq, None)
        if held is None:
            return  # already acknowledged or cleaned up
        seqs = self._by_rid.get(held.rid)
        if seqs is not None:
            seqs.discard(seq)
            if not seqs:
                del self._by_rid[held.rid]
        if held.dedicated is not None:
            held.dedicated.close()
            held.dedicated.unlink()
        self._release_slot(held.slot)
        if not held.future.done():
            if error is None:
                held.future.set_result(None)
            else:
                held.future.set_exception(error)
                held.future.exception()  # retrieved: nobody may be waiting on it

    def _abandon(self, slot: int, dedicated: Segment | None) -> None:
        self._copying -= 1
        if dedicated is not None:
            dedicated.close()
            dedicated.unlink()
        self._release_slot(slot)

    async def _acquire(self) -> int:
        if self._free and not self._waiters:
            return self._free.pop()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeout):
                return await waiter
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                self._release_slot(waiter.result())  # handed over just as we gave up
            else:
                waiter.cancel()
            if isinstance(e, TimeoutError):
                raise RelayTimeout(
                    f"no shared-memory slot came free in {self.timeout} s "
                    f"({self.credits} credits, all held by transfers in flight)"
                ) from None
            raise

    def _release_slot(self, slot: int) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._free.append(slot)

    # -- receiver side -------------------------------------------------------------------

    async def get_async(
        self, metadata: dict[str, Any], dest: torch.Tensor, request_id: str
    ) -> RelayOperation:
        name, offset, size = metadata["segment"], metadata["offset"], metadata["size"]
        is_pool = name.endswith("-pool")
        segment = self._attach(name) if is_pool else Segment(name, 0, create=False)
        try:
            if offset + size > segment.size:
                raise RelayError(f"shared memory {name} is smaller than the payload it announced")
            src = segment.tensor[offset : offset + size]
            await self._copy(lambda: copy_bytes(dest[:size], src), size)
        finally:
            src = None
            if not is_pool:
                segment.close()
        return _DoneOp(metadata)

    async def discard_async(self, metadata: dict[str, Any], request_id: str, src: int) -> None:
        return None  # nothing to read: the caller's DataAck frees the slot

    def _attach(self, name: str) -> Segment:
        segment = self._attached.get(name)
        if segment is None:
            for other in [n for n in self._attached if not is_alive(owner_pid(n) or 0)]:
                self._attached.pop(other).close()  # a dead sender's pool: let its memory go
            segment = self._attached[name] = Segment(name, 0, create=False)
        return segment

    # -- both ----------------------------------------------------------------------------

    def _copy(self, fn, nbytes: int) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if nbytes >= THREAD_COPY_BYTES:
            return loop.run_in_executor(None, fn)
        future = loop.create_future()
        try:
            fn()
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)
        return future

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "credits": self.credits,
            "free": len(self._free),
            "pending": len(self._held),
            "copying": self._copying,
            "dedicated": sum(1 for h in self._held.values() if h.dedicated is not None),
            "waiters": sum(1 for w in self._waiters if not w.done()),
            "rids": len(self._by_rid),
            "segment": self.pool.name,
        }

    def close(self) -> None:
        for seq in list(self._held):
            self._finish(seq, RelayAborted("the relay was closed"))
        for waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()
        for segment in self._attached.values():
            segment.close()
        self._attached.clear()
        self.pool.close()
        self.pool.unlink()


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
