"""Projections y = x W^T (+ b), with each weight held in the layout its platform's kernel wants.

The model keeps its weights as ordinary parameters (what loading and weight updates write);
`Platform.make_linear` turns each one into the object the forward pass calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """The portable projection: `F.linear` on the weight as loaded."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    @property
    def holds_weight(self) -> bool:
        """True when this object computes from the model's own weight tensor (no copy of it)."""
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MkldnnPackedLinear(Linear):
    """A CPU projection whose weight is reordered once, at load, into oneDNN's blocked layout.

    `F.linear` on a plain bfloat16/float32 weight makes oneDNN reorder the whole weight on
    every call, which at decode batch sizes costs more than the multiply itself: packed,
    the model's matmuls alone run ~1.4x faster at batch 1 and 32 (bfloat16; results are
    bit-identical there). Building one raises RuntimeError where the CPU or dtype has no
    packed kernel (float16 without AVX512-FP16, for one); see `pack_or_plain`.
    """

    # The row count the layout is tuned for; any count works. For float32 a hint of 1 is ~25%
    # slower at 8-32 rows than a hint of 32, which costs nothing at 1 row or at prefill sizes.
    BATCH_HINT = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.BATCH_HINT)  # a copy
        self.bias = None if bias is None else bias.detach()
        self.weight = None
        self.out_features, self.in_features = weight.shape

    @property
    def holds_weight(self) -> bool:
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_or_plain(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """The packed CPU projection where this machine has a kernel for the weight's dtype, else plain."""
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            return MkldnnPackedLinear(weight, bias)
        except RuntimeError:
            pass
    return Linear(weight, bias)
