"""This rank's torch.distributed groups and everything that crosses ranks.

One process group over every rank of the server, on the platform's backend (gloo on CPU,
NCCL on CUDA), carries the tensors: all-reduces and vocabulary gathers within a stage's
tensor-parallel ranks, activations from stage to stage. A second group, always gloo, carries
the leader's step orders to the followers (`broadcast_order`): followers wait on it between
steps, so its timeout is long; the tensor collectives have `--dist-timeout`, and a peer that
dies closes its sockets, which fails every collective waiting on it at once.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from typing import Any

import torch
import torch.distributed as dist

from cadence.distributed.layout import ModelShard, RankLayout

logger = logging.getLogger("cadence.distributed")

# Followers wait this long for the leader's next order; an idle leader sends one
# (`keep_alive`) well within it, so only a leader that is gone or stuck runs it out.
ORDER_TIMEOUT_S = 3600.0


class RankGroups:
    """The groups of one rank. Made in every rank process before the model loads; every
    rank creates the same groups in the same order (torch.distributed requires it)."""

    def __init__(
        self,
        layout: RankLayout,
        rank: int,
        init_addr: str,
        backend: str,
        timeout_s: float,
    ):
        self.layout, self.rank = layout, rank
        self.tp_rank, self.pp_rank = layout.tp_rank(rank), layout.pp_rank(rank)
        self.backend = backend
        self._timeout_s = timeout_s
        dist.init_process_group(
            backend,
            init_method=f"tcp://{init_addr}",
            rank=rank,
            world_size=layout.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.orders = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=ORDER_TIMEOUT_S)
        )
        self.tp_group = None
        for pp_rank in range(layout.pp_size):
            group = dist.new_group(layout.tp_group(pp_rank))
            if pp_rank == self.pp_rank:
                self.tp_group = group
        self._reduce_in_float32 = backend == "gloo"
        self.shm = None  # ShmCollectives of this stage's tensor-parallel ranks (`use_shm`)

    def use_shm(self, capacity: int) -> None:
        """Collective over this stage's tensor-parallel ranks (call on every rank, in the same
        order): all-reduces and logit gathers of up to `capacity` float32 elements go through
        shared memory where the group's ranks share this machine (see shm_collectives)."""
        from cadence.distributed.shm_collectives import (
            ShmCollectives,
            ShmUnavailable,
            shm_available,
        )

        lay = self.layout
        ranks = lay.tp_group(self.pp_rank)
        one_node = len({r // lay.ranks_per_node for r in ranks}) == 1
        if lay.tp_size == 1 or self.backend != "gloo" or not one_node or not shm_available():
            return
        try:
            self.shm = ShmCollectives(self.tp_group, ranks, self.rank, capacity, self._timeout_s)
        except ShmUnavailable:
            self.shm = None

    @property
    def shard(self) -> ModelShard:
        lay = self.layout
        return ModelShard(self.tp_rank, lay.tp_size, self.pp_rank, lay.pp_size)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- tensor parallel ---------------------------------------------------------------

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over this stage's tensor-parallel ranks, in place; returns it. Reduced
        partial sums in float32 on gloo (bfloat16 sums there would round at every rank)."""
        if self.shm is not None and self.shm.fits(x.numel()):
            return self.shm.all_reduce_(x)
        if x.dtype == torch.float32 or not self._reduce_in_float32:
            dist.all_reduce(x, group=self.tp_group)
            return x
        wide = x.float()
        dist.all_reduce(wide, group=self.tp_group)
        return x.copy_(wide)

    def all_gather_vocab(self, logits: torch.Tensor, rows_per_rank: int) -> torch.Tensor:
        """[rows, this rank's vocabulary] -> [rows, tp_size × rows_per_rank]: every rank's
        share side by side (a short last share padded)."""
        n = logits.shape[1]
        if n < rows_per_rank:
            logits = torch.nn.functional.pad(logits, (0, rows_per_rank - n))
        if self.shm is not None and self.shm.fits(logits.numel()):
            return torch.cat(self.shm.all_gather(logits), dim=1)
        parts = [torch.empty_like(logits) for _ in range(self.layout.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=1)

    # ---- pipeline ----------------------------------------------------------------------

    def _peer(self, pp_rank: int) -> int:
        return self.layout.rank_of(pp_rank, self.tp_rank)

    def send_to_next(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), self._peer(self.pp_rank + 1))

    def recv_from_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self._device())
        dist.recv(x, self._peer(self.pp_rank - 1))
        return x

    def send_to_first(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), self._peer(0))

    def recv_from_last(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self._device())
        dist.recv(x, self._peer(self.layout.pp_size - 1))
        return x

    def isend_to_next(self, x: torch.Tensor):
        """`send_to_next` that returns at once: the caller waits on the returned work (and
        keeps `x` unchanged until then)."""
        return dist.isend(x, self._peer(self.pp_rank + 1))

    def isend_to_first(self, x: torch.Tensor):
        return dist.isend(x, self._peer(0))

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---- the leader's orders -------------------------------------------------------------

    def broadcast_order(self, order: Any = None) -> Any:
        """The leader sends `order` to every rank; a follower passes None and gets it."""
        if self.is_leader:
            data = pickle.dumps(order, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, 0, group=self.orders)
            dist.broadcast(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.orders
            )
            return order
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.orders)
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.orders)
        return pickle.loads(buf.numpy().tobytes())

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (what all ranks' memory allows)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.orders)
        return int(t)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
