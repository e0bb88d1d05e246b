"""Projections y = x W^T (+ b), with each weight held in the layout its platform's kernel wants.

The model keeps its weights as ordinary parameters (what loading and weight updates write);
`Platform.make_linear` turns each one into the object the forward pass calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """The portable projection: `F.linear` on the weight as loaded."""

    holds_weight = True
    """True when the projection computes from the model's own weight tensor (no copy of it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """y in float32, from rows of any float dtype (a model's logits). Here x is widened
        first; a projection that reads 16-bit rows as they are overrides this."""
        return self(x.float())


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
    holds_weight = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), self.BATCH_HINT
        )  # a copy
        super().__init__(weight, None if bias is None else bias.detach())
        self.weight = None  # the packed copy is what runs; the model may release the original

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


TOP_LOGIT_BLOCK = 64


def refine_top_logits(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Recomputes in float32, in place, every logit close enough to its row's maximum to be it.

    `logits` [rows, vocab] float32 came out of a bfloat16/float16 projection of `hidden` by
    `weight` [vocab, hidden], so each was rounded to 8 (11) significant bits: at a logit of
    20, steps of 0.125. The best candidates of a row then collapse into ties, and greedy
    decoding picks among them by token id (a 135M model answers "L'Étoile..." instead of
    "The capital of France is Paris."). Rounding moves a value by at most 2^-8 of itself,
    so every token that can hold the true maximum lies within 2^-6 of the rounded maximum;
    those few are recomputed exactly. The search runs over blocks of 64 logits (a vectorized
    max), then inside the blocks that can hold a candidate.
    """
    rows, vocab = logits.shape
    width = vocab - vocab % TOP_LOGIT_BLOCK
    blocks = logits[:, :width].view(rows, -1, TOP_LOGIT_BLOCK)
    block_max = blocks.amax(-1)  # [rows, blocks]
    top = block_max.amax(-1, keepdim=True) if width else logits.amax(-1, keepdim=True)
    tail = logits[:, width:]
    if width < vocab:
        top = torch.maximum(top, tail.amax(-1, keepdim=True))
    floor = top - (top.abs() * 2**-6 + 1e-3)  # [rows, 1]: below it, no token can be the maximum
    block_rows, block_ids = (block_max >= floor).nonzero(as_tuple=True)
    hit_rows, hit_cols = (blocks[block_rows, block_ids] >= floor[block_rows]).nonzero(as_tuple=True)
    cand_rows = block_rows[hit_rows]
    cand_ids = block_ids[hit_rows] * TOP_LOGIT_BLOCK + hit_cols
    if width < vocab:
        tail_rows, tail_cols = (tail >= floor).nonzero(as_tuple=True)
        cand_rows = torch.cat([cand_rows, tail_rows])
        cand_ids = torch.cat([cand_ids, tail_cols + width])
    exact = (hidden[cand_rows].float() * weight[cand_ids].float()).sum(-1)
    logits[cand_rows, cand_ids] = exact
    return logits
