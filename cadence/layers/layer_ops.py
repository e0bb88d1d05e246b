"""The element-wise work of a decoder layer, behind one interface the platform picks.

`LayerOps` is the portable implementation on torch ops. `CpuFusedOps` runs each of these
as one of Cadence's C++ kernels (cadence/kernels): the same math in float32 with a single
rounding, without the several small ops (and their fixed costs) torch spends on each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.layers.linear import refine_top_logits


class LayerOps:
    """RMSNorm, the residual add fused into it, SiLU-and-multiply, rotary embedding, and the
    float32 logits of a low-precision LM head.

    Invariants: inputs are 2-D [tokens, features] with a contiguous last dimension (rows may
    be strided views); outputs have the input's dtype. `add_rms_norm_` and `rotary_` write
    their first argument in place; nothing else is written.
    """

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm_(
        self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x, then returns rms_norm(residual)."""
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])

    def refined_logits(
        self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """float32 logits from a bfloat16/float16 LM head output [rows, vocab], the ones that
        can still be their row's maximum recomputed in float32 (`refine_top_logits`)."""
        return refine_top_logits(logits.float(), hidden, weight)

    def rope_factors(self, factors: torch.Tensor) -> torch.Tensor:
        """This step's complex64 [T, heads, D/2] factors in the form `rotary_` takes (once per step)."""
        return factors

    def rotary_(self, qk: torch.Tensor, factors) -> None:
        """Rotates q and k in place, [T, heads * D] in the interleaved pair layout, each pair
        times its complex factor."""
        t = qk.shape[0]
        if qk.dtype in (torch.float32, torch.float64):
            torch.view_as_complex(qk.view(t, *factors.shape[1:], 2)).mul_(factors)
        else:  # complex numbers need float32 parts: rotate a float32 copy and write it back
            rotated = torch.view_as_complex(qk.float().view(t, *factors.shape[1:], 2)).mul_(factors)
            qk.copy_(torch.view_as_real(rotated).view(t, -1))

    def lora_arguments(
        self,
        scales: list[float],
        a: list[torch.Tensor],
        bt: list[torch.Tensor],
        offsets: tuple[int, ...],
    ) -> tuple:
        """A projection's adapter arguments as `lora_products_` takes them after (y, x, rows,
        starts): prepared once per batch of adapters (`LoraBatch` keeps them)."""
        return scales, a, bt, offsets

    def lora_products_(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        rows: torch.Tensor,
        starts: list[int],
        scales: list[float],
        a: list[torch.Tensor],
        bt: list[torch.Tensor],
        offsets: tuple[int, ...],
    ) -> None:
        """In place, for each group g of rows `rows[starts[g]:starts[g + 1]]` and each part p
        of the projection (P = len(offsets)): y[row, offsets[p]:] += scales[g] (x[row] A^T)
        B^T, with A = a[g * P + p] [r, in] and B^T = bt[g * P + p] [r, out_p] (r = 0:
        nothing). The products run in the wider of x's and the weights' dtypes."""
        parts = len(offsets)
        every = len(starts) == 2 and starts[1] == y.shape[0]  # one group: rows is 0..T-1
        for g in range(len(starts) - 1):
            idx = rows[starts[g] : starts[g + 1]]
            xs = None
            for p, offset in enumerate(offsets):
                ap, btp = a[g * parts + p], bt[g * parts + p]
                if ap.shape[0] == 0:
                    continue
                wide = torch.promote_types(x.dtype, ap.dtype)
                if xs is None:
                    xs = (x if every else x.index_select(0, idx)).to(wide)
                delta = (((xs @ ap.to(wide).T) * scales[g]) @ btp.to(wide)).to(y.dtype)
                columns = y[:, offset : offset + btp.shape[1]]
                if every:
                    columns.add_(delta)
                else:
                    columns.index_add_(0, idx, delta)


class CpuFusedOps(LayerOps):
    """`LayerOps` through Cadence's CPU kernels (available only once they are loaded)."""

    def __init__(self):
        self._ops = torch.ops.cadence

    def rms_norm(self, x, weight, eps):
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm_(self, residual, x, weight, eps):
        return self._ops.add_rms_norm_(residual, x, weight, eps)

    def silu_and_mul(self, gate_up):
        return self._ops.silu_and_mul(gate_up)

    def refined_logits(self, logits, hidden, weight):
        return self._ops.refined_logits(logits, hidden, weight)

    def rope_factors(self, factors):
        return torch.view_as_real(factors)  # float32 [T, heads, D/2, 2]

    def rotary_(self, qk, factors):
        self._ops.rotary_(qk, factors)

    def lora_arguments(self, scales, a, bt, offsets):
        # One checked table of the parts (their addresses, shapes and strides): the kernel
        # then reads one small tensor per call, not two per adapter and part. The table
        # holds addresses, so the tensors it was made from travel with it.
        return scales, self._ops.lora_table.default(a, bt, list(offsets)), (a, bt)

    def lora_products_(self, y, x, rows, starts, scales, table, held=None):
        self._ops.lora_products_table_.default(y, x, rows, starts, scales, table)
