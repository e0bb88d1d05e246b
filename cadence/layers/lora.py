"""LoRA products for a batch whose rows use different adapters, or none.

A projection y = x W^T gains, for the tokens of a request served with an adapter,
y += (x A^T) B^T: A [rank, in] and B [out, rank] with the adapter's scaling folded into B
at load. The model's projections are fused (q|k|v in one matrix, gate|up in another), so an
adapter's parts are fused the same way: their A matrices stacked (one product gives every
part's low-rank activations), their B matrices placed block-diagonally on the fused output's
rows. A part the adapter does not target is a zero block; a projection it does not target at
all has no entry and costs nothing.

A step's tokens are grouped by adapter once (`LoraBatch`), and each layer applies one pair
of matmuls per adapter present in the batch, over that adapter's tokens (gathered when the
batch mixes adapters, in place when one adapter has every token): a segmented matmul, not a
loop over rows. The base projection (dense or quantized) is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """One adapter on one fused projection."""

    a: torch.Tensor  # [rank_total, in_features], the stacked A of the targeted parts
    b: torch.Tensor  # [out_features, rank_total], block-diagonal B, scaling folded in


class LoraWeights:
    """One adapter's products, per layer and fused projection, on the model's device and in
    its activation dtype."""

    def __init__(self, layers: list[dict[str, LoraProduct]]):
        self.layers = layers

    @property
    def nbytes(self) -> int:
        return sum(
            p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
            for layer in self.layers
            for p in layer.values()
        )


class LoraBatch:
    """A step's tokens grouped by adapter: for each adapter present, its weights and the
    rows (flat token indices) it applies to (None: every row of the step)."""

    def __init__(self, groups: list[tuple[LoraWeights, torch.Tensor | None]]):
        self.groups = groups

    @classmethod
    def build(
        cls, adapters: list[LoraWeights | None], counts: list[int], device
    ) -> LoraBatch | None:
        """`adapters[i]` serves the `counts[i]` consecutive tokens of request i; None when
        no request of the step has an adapter."""
        present = [a for a in adapters if a is not None]
        if not present:
            return None
        first = present[0]
        if len(present) == len(adapters) and all(a is first for a in present):
            return cls([(first, None)])
        rows: dict[int, tuple[LoraWeights, list[int]]] = {}
        start = 0
        for adapter, count in zip(adapters, counts):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + count))
            start += count
        return cls(
            [
                (adapter, torch.tensor(idx, dtype=torch.int64, device=device))
                for adapter, idx in rows.values()
            ]
        )

    def apply(self, layer_id: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x, [tokens, out]) plus every adapter's product on its
        rows; `y` is written in place and returned."""
        for adapter, rows in self.groups:
            product = adapter.layers[layer_id].get(proj)
            if product is None:
                continue
            if rows is None:
                low = x.to(product.a.dtype) @ product.a.T
                y.add_((low @ product.b.T).to(y.dtype))
            else:
                low = x.index_select(0, rows).to(product.a.dtype) @ product.a.T
                y.index_add_(0, rows, (low @ product.b.T).to(y.dtype))
        return y
