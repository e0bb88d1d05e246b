"""All-reduce and all-gather through shared memory, for the tensor-parallel ranks of a stage
that share one machine (x86 hosts).

torch.distributed makes the groups and meets the ranks; gloo carries every other collective.
On this path gloo's TCP transport costs one or two wake-ups of a device thread per message:
~700 µs for a [1, 576] float32 all-reduce between two local processes on a 2-core VM, where
a decode step of a 30-layer model calls it 60 times. Here each rank writes its tensor into
its own slot of a shared segment, publishes a sequence number, waits (spinning, then
yielding the core) until every rank of the group has published, and reads all the slots,
summing them in rank order, so every rank gets the same bits. SGLang's and vLLM's CPU
backends do the same (a shared-memory all-reduce beside the process group).

Two slot sets are used in turn: a rank writing call k + 1 cannot overwrite call k's data
while another rank still reads it, since it only finishes call k + 1 after every rank
published it, which each does only after reading call k. x86's store order makes a slot's
data visible before the sequence number written after it; other architectures keep gloo.
The segment is created by the group's first rank in /dev/shm and unlinked as soon as every
rank has mapped it, so nothing outlives the processes. Tensors beyond the slots' capacity
go through gloo.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger("cadence.distributed")

_LINE = 64  # bytes: each rank's sequence numbers on their own cache line
_SPINS_BEFORE_YIELD = 2000
_CHECK_EVERY = 1024  # spins between two looks at the clock (the timeout)


def shm_available() -> bool:
    """Shared memory collectives run here: an x86 host with /dev/shm (CADENCE_SHM_COLLECTIVES=0
    turns them off)."""
    from cadence import envs

    return (
        envs.shm_collectives()
        and platform.machine().lower() in ("x86_64", "amd64")
        and os.path.isdir("/dev/shm")
    )


class ShmUnavailable(RuntimeError):
    """The segment could not be made: the group keeps gloo."""


class ShmCollectives:
    """One tensor-parallel group's shared segment. Every rank of `ranks` (global ranks, all on
    this machine) makes one, collectively, in the same order."""

    def __init__(self, group, ranks: list[int], rank: int, capacity: int, timeout_s: float):
        self.size, self.me = len(ranks), ranks.index(rank)
        self.capacity = capacity  # float32 elements per slot
        self.timeout_s = timeout_s
        header = self.size * 2 * _LINE
        nbytes = header + 2 * self.size * capacity * 4
        name: list[str | None] = [None]
        if self.me == 0:
            path = f"/dev/shm/cadence-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            try:
                with open(path, "wb") as f:
                    # Reserved, not just sized: a sparse file on a full tmpfs would be SIGBUS at
                    # the first write (a container's /dev/shm is often 64 MiB).
                    os.posix_fallocate(f.fileno(), 0, nbytes)
                name = [path]
            except OSError as e:  # no room in /dev/shm: every rank keeps gloo
                if os.path.exists(path):
                    os.unlink(path)
                logger.warning("no shared memory for tensor-parallel collectives (%s): gloo", e)
        dist.broadcast_object_list(name, src=ranks[0], group=group)
        if name[0] is None:
            raise ShmUnavailable("the group's first rank could not make the segment")
        with open(name[0], "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), nbytes)
        dist.barrier(group=group)  # every rank has it mapped: the name can go
        if self.me == 0:
            os.unlink(name[0])
        # seq[r, b]: the last call rank r published in slot set b (int64, one per cache line).
        self.seq = np.frombuffer(self.mm, np.int64, self.size * 2 * _LINE // 8).reshape(
            self.size, 2, _LINE // 8
        )[:, :, 0]
        self.slots = np.frombuffer(self.mm, np.float32, 2 * self.size * capacity, header).reshape(
            2, self.size, capacity
        )
        self.calls = 0

    def fits(self, numel: int) -> bool:
        return numel <= self.capacity

    def _publish(self, values: np.ndarray) -> tuple[int, np.ndarray]:
        """Writes this rank's values for the next call, waits for every rank's; returns the
        slot set [size, capacity] holding them."""
        self.calls += 1
        call, b = self.calls, self.calls & 1
        slots = self.slots[b]
        slots[self.me, : values.size] = values
        self.seq[self.me, b] = call
        seq = self.seq[:, b]
        spins = 0
        deadline = None
        while (seq != call).any():
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()  # more ranks than cores: let the others run
            if spins % _CHECK_EVERY == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise RuntimeError(
                        f"shared-memory collective: ranks {np.flatnonzero(seq != call).tolist()} "
                        f"of this tensor-parallel group did not arrive within {self.timeout_s:g} s"
                    )
        return call, slots

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` (a host tensor) over the group in place, in rank order; returns it."""
        values = x.detach().float().contiguous().view(-1).numpy()
        n = values.size
        _, slots = self._publish(values)
        out = np.add(slots[0, :n], slots[1, :n])
        for r in range(2, self.size):
            out += slots[r, :n]
        return x.copy_(torch.from_numpy(out).view(x.shape))

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on all), in rank order (float32 copies)."""
        values = x.detach().float().contiguous().reshape(-1).numpy()
        n = values.size
        _, slots = self._publish(values)
        return [torch.from_numpy(slots[r, :n].copy()).view(x.shape) for r in range(self.size)]

    def close(self) -> None:
        self.seq = self.slots = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:  # a view still lives somewhere: the mapping goes with the process
            pass
