"""Who is who among the ranks, and which slice of the model each one holds. Pure arithmetic:
no torch, so the launcher and the argument checks read it before anything heavy loads.

Ranks are numbered tensor-parallel first, as SGLang numbers them: rank = pp_rank × tp_size +
tp_rank. Node n runs ranks [n × per_node, (n + 1) × per_node); rank 0 (on node 0) runs the
scheduler, and is the first stage's first tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_evenly(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) of part `index` when `total` (a multiple of `unit`) is cut into `parts`
    contiguous pieces of whole units, the first ones one unit larger where it does not divide."""
    units, extra = divmod(total // unit, parts)
    start = index * units + min(index, extra)
    end = start + units + (1 if index < extra else 0)
    return start * unit, end * unit


def stage_layer_counts(num_layers: int, stages: int, first_extra: float) -> list[int]:
    """Layers per pipeline stage for an even load when the first stage also does work worth
    `first_extra` layers; every stage keeps at least one."""
    if stages == 1:
        return [num_layers]
    share = (num_layers + first_extra) / stages
    first = min(max(1, round(share - first_extra)), num_layers - (stages - 1))
    rest = [
        b - a
        for a, b in (split_evenly(num_layers - first, stages - 1, i) for i in range(stages - 1))
    ]
    return [first, *rest]


@dataclass(frozen=True)
class RankLayout:
    """The ranks of one server: tp_size × pp_size processes over nnodes machines."""

    tp_size: int = 1
    pp_size: int = 1
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: int) -> range:
        """The global ranks machine `node_rank` runs."""
        n = self.ranks_per_node
        return range(node_rank * n, (node_rank + 1) * n)

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_group(self, pp_rank: int) -> list[int]:
        """The ranks of one stage, which split its layers' tensors."""
        return [pp_rank * self.tp_size + t for t in range(self.tp_size)]

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank


@dataclass(frozen=True)
class ModelShard:
    """The slice of a decoder one rank holds: its stage's layers, and within them its
    tensor-parallel share of heads, of the MLP and of the vocabulary."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layers(
        self, num_layers: int, first_extra: float = 0.0, partition: list[int] | None = None
    ) -> range:
        """This stage's contiguous range of the model's layers: `partition` (layers per stage,
        as SGLANG_PP_LAYER_PARTITION gives them) or an even load, where the first stage's
        other work (the LM head and sampling) counts as `first_extra` layers."""
        if num_layers < self.pp_size:
            raise ValueError(
                f"pp_size ({self.pp_size}) exceeds the model's {num_layers} layers: each "
                "pipeline stage needs at least one"
            )
        if partition is not None:
            if len(partition) != self.pp_size or sum(partition) != num_layers or min(partition) < 1:
                raise ValueError(
                    f"SGLANG_PP_LAYER_PARTITION {partition} must give each of the {self.pp_size} "
                    f"stages at least one of the {num_layers} layers"
                )
            counts = partition
        else:
            counts = stage_layer_counts(num_layers, self.pp_size, first_extra)
        start = sum(counts[: self.pp_rank])
        return range(start, start + counts[self.pp_rank])

    def kv_heads(self, num_kv_heads: int) -> range:
        """This rank's key-value heads; the query heads of their groups come with them."""
        if num_kv_heads < self.tp_size:
            raise ValueError(
                f"tp_size ({self.tp_size}) exceeds the model's {num_kv_heads} key-value heads: "
                "each tensor-parallel rank needs at least one; use a smaller --tp-size"
            )
        return range(*split_evenly(num_kv_heads, self.tp_size, self.tp_rank))

    def q_heads(self, num_heads: int, num_kv_heads: int) -> range:
        group = num_heads // num_kv_heads
        kv = self.kv_heads(num_kv_heads)
        return range(kv.start * group, kv.stop * group)

    def intermediate(self, size: int) -> range:
        """This rank's columns of the MLP, cut at whole quantized blocks (256 or 32 columns)
        where the size allows, so that a block never straddles two ranks."""
        unit = next((u for u in (256, 32) if size % (u * self.tp_size) == 0), None)
        if unit is None:
            unit = next(u for u in (256, 32, 1) if size % u == 0 and size // u >= self.tp_size)
        return range(*split_evenly(size, self.tp_size, self.tp_rank, unit))

    def vocab(self, vocab_size: int) -> range:
        """This rank's rows of the embedding table and the LM head. Every rank's share has
        `vocab_rows(vocab_size)` rows; the last ones may run past the vocabulary (padding)."""
        rows = self.vocab_rows(vocab_size)
        start = min(self.tp_rank * rows, vocab_size)
        return range(start, min(start + rows, vocab_size))

    def vocab_rows(self, vocab_size: int) -> int:
        return -(-vocab_size // self.tp_size)
