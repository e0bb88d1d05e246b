"""LoRA products for a batch whose rows use different adapters, or none.

A projection y = x W^T gains, for the tokens of a request served with an adapter,
y += s (x A^T) B^T: A [rank, in], B [out, rank] and the adapter's scaling s (lora_alpha / r,
or / sqrt(r) for rsLoRA). The model's projections are fused (q|k|v in one matrix, gate|up in another), so an
adapter's product on a fused projection is kept per part: A_p and B_p^T for each part it
targets (an empty [0, ...] pair for one it does not), part p writing the output columns from
its offset. A projection the adapter does not target at all has no entry and costs nothing.

A step's tokens are grouped by adapter once (`LoraBatch`), and each layer's projection adds
every group's products in one call of `LayerOps.lora_products_`: on the CPU one kernel for
the whole step (a segmented matmul: each adapter's weights read once for all its rows), in
torch a pair of matmuls per adapter and part. The base projection (dense or quantized) is
untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cadence.layers.layer_ops import LayerOps

# The fused projections of a decoder layer, and the PEFT module names fused into each.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGET_MODULES = tuple(part for parts in FUSED_PARTS.values() for part in parts)


@dataclass
class LoraProduct:
    """One adapter on one fused projection, part by part (`FUSED_PARTS` order)."""

    a: tuple[torch.Tensor, ...]  # per part: A [r, in]; [0, in] where the part is not targeted
    bt: tuple[torch.Tensor, ...]  # per part: B^T [r, out_p]
    offsets: tuple[int, ...]  # per part: its first column of the fused output
    scale: float = 1.0  # the adapter's scaling


class LoraWeights:
    """One adapter's products, per layer and fused projection, on the model's device and in
    its activation dtype."""

    def __init__(self, layers: list[dict[str, LoraProduct]]):
        self.layers = layers

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for product in layer.values()
            for t in (*product.a, *product.bt)
        )


# The products' arguments of one projection: (scales, A parts, B^T parts, offsets); None
# where no adapter of the batch targets it. `LayerOps.lora_arguments` prepares them for its
# `lora_products_` (the CPU kernel's: one table of the parts).
Gathered = tuple[list[float], list[torch.Tensor], list[torch.Tensor], tuple[int, ...]]
ProductArgs = tuple | None
# The largest number of group compositions a `LoraBatch.build` cache keeps (then it starts over).
MAX_CACHED_BATCHES = 32


class LoraBatch:
    """A step's tokens grouped by adapter: `adapters[g]` serves the flat token indices
    `rows[starts[g]:starts[g + 1]]` (group order; a request without an adapter is in no
    group). The products' arguments of each projection are gathered once per group
    composition (`args`): a decode batch keeps its adapters for many steps, and gathering
    them anew for each of a step's ~120 projections cost about 25 us each."""

    def __init__(
        self,
        adapters: list[LoraWeights],
        rows: torch.Tensor,
        starts: list[int],
        args: dict[tuple[int, str], ProductArgs] | None = None,
    ):
        self.adapters = adapters
        self.rows = rows
        self.starts = starts
        self.args: dict[tuple[int, str], ProductArgs] = {} if args is None else args

    @classmethod
    def build(
        cls,
        adapters: list[LoraWeights | None],
        counts: list[int],
        device,
        cache: dict[tuple[int, ...], dict] | None = None,
    ) -> LoraBatch | None:
        """`adapters[i]` serves the `counts[i]` consecutive tokens of request i; None when
        no request of the step has an adapter. `cache` (the adapters' owner's, cleared
        whenever an adapter's weights are freed, so an id in a key is always a live
        adapter's) keeps the products' arguments by group composition across steps."""
        groups: dict[int, tuple[LoraWeights, list[int]]] = {}
        start = 0
        for adapter, count in zip(adapters, counts):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + count))
            start += count
        if not groups:
            return None
        rows: list[int] = []
        starts = [0]
        for _, idx in groups.values():
            rows.extend(idx)
            starts.append(len(rows))
        order = torch.tensor(rows, dtype=torch.int64, device=device)
        args = None
        if cache is not None:
            if len(cache) >= MAX_CACHED_BATCHES:
                cache.clear()
            args = cache.setdefault(tuple(groups), {})
        return cls([adapter for adapter, _ in groups.values()], order, starts, args)

    def apply(
        self, layer_id: int, proj: str, x: torch.Tensor, y: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        """y (the base projection of x, [tokens, out]) plus every adapter's product on its
        rows; `y` is written in place and returned."""
        key = (layer_id, proj)
        if key in self.args:
            args = self.args[key]
        else:
            gathered = self._gather(layer_id, proj)
            args = self.args[key] = None if gathered is None else ops.lora_arguments(*gathered)
        if args is not None:
            ops.lora_products_(y, x, self.rows, self.starts, *args)
        return y

    def _gather(self, layer_id: int, proj: str) -> Gathered | None:
        products = [adapter.layers[layer_id].get(proj) for adapter in self.adapters]
        present = next((p for p in products if p is not None), None)
        if present is None:
            return None
        a: list[torch.Tensor] = []
        bt: list[torch.Tensor] = []
        scales: list[float] = []
        for product in products:
            if product is None:
                product = _untargeted(present)
            a.extend(product.a)
            bt.extend(product.bt)
            scales.append(product.scale)
        return scales, a, bt, present.offsets


def _untargeted(like: LoraProduct) -> LoraProduct:
    """Empty parts shaped like `like`'s: an adapter that does not target this projection."""
    empty_a = like.a[0].new_empty(0, like.a[0].shape[1])
    empty_bt = like.bt[0].new_empty(0, 0)
    n = len(like.a)
    return LoraProduct((empty_a,) * n, (empty_bt,) * n, like.offsets)
