"""`shm`: host shared memory between processes of one machine.

Each process owns one pool segment, `/dev/shm/cadence-relay-<pid>-<pipeline>-pool`, cut in
`credits` slots of `slot_mb` MiB. A put takes a slot (waiting for one if none is free: that is
the credit), copies the packed payload in and returns metadata naming the segment, offset
and size; the receiver copies it out and sends DataAck, which frees the slot. A payload
larger than a slot gets a segment of its own (`...-d<seq>`, still one credit), unlinked when
acknowledged. A slot is also freed by `cleanup(request_id)` and by `close()`.

Zero-copy receive: a put of at least `zero_copy_min_bytes`, made while at least half the
sender's credits are free, is marked `lend`. Its receiver reads it in place (`lend`: the
restored tensors are views of the sender's slot) and acknowledges twice: at once with its
pid (`borrower`: the put is delivered, the sender's request can end, the slot stays the
receiver's) and again once the last view is gone (the slot is free). A slot lent to a
process that died is taken back (its pid is checked whenever credits run short and on
`stats()`); a lent put cleaned up before any acknowledgement keeps its slot for
LEND_GRACE_S, in case the receiver already reads it.

Every name carries the owner's pid, so whatever a killed process leaves behind is found and
removed by `sweep_dead_segments()`, which every relay runs when it starts (and the launcher
after a stage process dies). Linux only: segments are files under /dev/shm, mapped with mmap
(no multiprocessing.shared_memory, whose resource tracker would unlink segments it does not
own when a reader exits).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence.liveness import is_alive
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
SPLIT_COPY_BYTES = 4 << 20  # larger puts copy in COPY_PARTS parts at once
COPY_PARTS = 2
LEND_GRACE_S = 2.0  # a lent put cleaned up before any acknowledgement keeps its slot this long


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
    lent: bool = False


@dataclass
class _Borrowed:
    """A lent slot, delivered (or abandoned), until its borrower lets it go."""

    slot: int
    dedicated: Segment | None
    pid: int | None  # the borrower; None while unknown (cleaned up before any ack)


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
        self.lend_min = ctx.config.zero_copy_min_bytes
        self._borrowed: dict[int, _Borrowed] = {}  # seq -> our slot lent to a receiver
        self._lent = 0  # receiver side: puts of others read in place, views still alive
        self._lent_lock = threading.Lock()  # views die on any thread

    # -- sender side ---------------------------------------------------------------------

    async def put_async(self, tensor: torch.Tensor, request_id: str, dst: int) -> RelayOperation:
        def fill(region: torch.Tensor, start: int, end: int) -> None:
            copy_bytes(region[start:end], tensor[start:end])

        return await self._put(tensor.numel(), fill, request_id)

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
        copied = self._fill(fill, region, nbytes)
        try:
            await asyncio.shield(copied)
        except BaseException:
            # Cancelled (or failed) while a thread may still write: free it once that is over.
            copied.add_done_callback(lambda _: self._abandon(slot, dedicated))
            raise
        self._copying -= 1
        future = asyncio.get_running_loop().create_future()
        lend = self.lend_min is not None and nbytes >= self.lend_min
        lend = lend and 2 * len(self._free) >= self.credits
        self._held[seq] = _Held(rid, slot, future, dedicated, lend)
        self._by_rid.setdefault(rid, set()).add(seq)
        segment = dedicated.name if dedicated else self.pool.name
        meta = {"segment": segment, "offset": offset, "size": nbytes, "seq": seq, "pid": self.pid}
        if lend:
            meta["lend"] = True
        return _PutOp(meta, future)

    def acknowledge(self, metadata: dict[str, Any]) -> None:
        if metadata.get("pid") != self.pid:
            return
        seq, borrower = metadata.get("seq"), metadata.get("borrower")
        borrowed = self._borrowed.get(seq)
        if borrowed is not None:
            if borrower is None:  # the borrower let it go
                self._return(seq)
            else:
                borrowed.pid = borrower
            return
        held = self._held.get(seq)
        if borrower is not None and held is not None:  # delivered; the slot stays lent
            self._borrowed[seq] = _Borrowed(held.slot, held.dedicated, borrower)
            held.dedicated = None
            self._forget(seq, held, None, release=False)
            return
        self._finish(seq, None)

    def cleanup(self, request_id: str) -> None:
        for seq in self._by_rid.pop(request_id, ()):
            error = RelayAborted(f"request {request_id} was cleaned up")
            held = self._held.get(seq)
            if held is not None and held.lent:  # its receiver may be reading it already
                self._borrowed[seq] = _Borrowed(held.slot, held.dedicated, None)
                held.dedicated = None
                self._forget(seq, held, error, release=False)
                self._return_later(seq)
            else:
                self._finish(seq, error)

    def _return_later(self, seq: int) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._return(seq)
            return

        def expire() -> None:
            borrowed = self._borrowed.get(seq)
            if borrowed is not None and borrowed.pid is None:  # nobody took it
                self._return(seq)

        loop.call_later(LEND_GRACE_S, expire)

    def _return(self, seq: int) -> None:
        borrowed = self._borrowed.pop(seq, None)
        if borrowed is None:
            return
        if borrowed.dedicated is not None:
            borrowed.dedicated.close()
            borrowed.dedicated.unlink()
        self._release_slot(borrowed.slot)

    def _reclaim_from_dead(self) -> None:
        """Takes back the slots lent to processes that died holding them."""
        for seq in [s for s, b in self._borrowed.items() if b.pid and not is_alive(b.pid)]:
            self._return(seq)

    def _finish(self, seq: Any, error: Exception | None) -> None:
        held = self._held.get(seq)
        if held is not None:  # else already acknowledged or cleaned up
            self._forget(seq, held, error, release=True)

    def _forget(self, seq: int, held: _Held, error: Exception | None, release: bool) -> None:
        """Ends the put: its future resolves, its slot is freed unless still lent."""
        del self._held[seq]
        seqs = self._by_rid.get(held.rid)
        if seqs is not None:
            seqs.discard(seq)
            if not seqs:
                del self._by_rid[held.rid]
        if held.dedicated is not None:
            held.dedicated.close()
            held.dedicated.unlink()
        if release:
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
        if not self._free and self._borrowed:
            self._reclaim_from_dead()
        if self._free and not self._waiters:
            return self._free.pop()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeout):
                while True:  # a borrower may die while we wait: look again every second
                    done, _ = await asyncio.wait({waiter}, timeout=1.0)
                    if done:
                        return waiter.result()
                    self._reclaim_from_dead()
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

    def lend(self, metadata: dict[str, Any], on_release: Callable[[], None]) -> torch.Tensor | None:
        if not metadata.get("lend") or not metadata.get("size"):
            return None
        name, offset, size = metadata["segment"], metadata["offset"], metadata["size"]
        dedicated = None if name.endswith("-pool") else Segment(name, 0, create=False)
        segment = dedicated or self._attach(name)
        if offset + size > segment.size:
            if dedicated is not None:
                dedicated.close()
            raise RelayError(f"shared memory {name} is smaller than the payload it announced")
        view = memoryview(segment.mm)[offset : offset + size]
        tensor = torch.frombuffer(view, dtype=torch.uint8)
        with self._lent_lock:
            self._lent += 1

        def released() -> None:  # the tensor's storage let go of `view`: no view is left
            with self._lent_lock:
                self._lent -= 1
            if dedicated is not None:
                dedicated.close()
            on_release()

        weakref.finalize(view, released)
        return tensor

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

    def _fill(self, fill, region: torch.Tensor, nbytes: int) -> asyncio.Future:
        """fill(region, start, end) over [0, nbytes): a large copy in parts on worker
        threads, at once, so that one copy uses the memory bandwidth of several cores."""
        if nbytes < SPLIT_COPY_BYTES:
            return self._copy(lambda: fill(region, 0, nbytes), nbytes)
        loop = asyncio.get_running_loop()
        step = _round_up(-(-nbytes // COPY_PARTS), 4096)
        parts = [
            loop.run_in_executor(None, fill, region, start, min(start + step, nbytes))
            for start in range(step, nbytes, step)
        ]
        try:
            fill(region, 0, step)  # the first part here, while the workers wake up
        except Exception as e:
            parts.append(_failed(loop, e))
        return asyncio.gather(*parts)

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
        self._reclaim_from_dead()
        if self._lent:
            # A view is let go when its tensor is freed; one held by a reference cycle (a
            # cancelled run's frames and its CancelledError) only when the collector runs,
            # which an idle stage process may not do for a long time. Collect before
            # counting, so the figures say what is really still in use.
            gc.collect()
        return {
            "backend": self.name,
            "credits": self.credits,
            "free": len(self._free),
            "pending": len(self._held),
            "borrowed": len(self._borrowed),  # our slots lent to receivers
            "lent": self._lent,  # others' slots this process reads in place
            "copying": self._copying,
            "dedicated": sum(1 for h in self._held.values() if h.dedicated is not None),
            "waiters": sum(1 for w in self._waiters if not w.done()),
            "rids": len(self._by_rid),
            "segment": self.pool.name,
        }

    def close(self) -> None:
        for seq in list(self._held):
            self._finish(seq, RelayAborted("the relay was closed"))
        for seq in list(self._borrowed):
            self._return(seq)
        for waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()
        for segment in self._attached.values():
            segment.close()
        self._attached.clear()
        self.pool.close()
        self.pool.unlink()


def _failed(loop: asyncio.AbstractEventLoop, error: Exception) -> asyncio.Future:
    future = loop.create_future()
    future.set_exception(error)
    return future


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
