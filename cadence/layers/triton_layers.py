"""The CUDA platform's attention backend and layer ops, on Cadence's Triton kernels
(`cadence.kernels.triton_ops`).

A decoder layer is then nine launches: the fused residual add and RMSNorm, the q/k/v
projection, rotary with the K/V store, paged attention, the o projection, the second add
and norm, gate/up, SiLU-and-multiply, down. None of them depends on a host value, and
decode passes the same tensors at the same shapes every step: what a CUDA graph captures
(`cadence.platforms.cuda_graph`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.kernels import triton_ops
from cadence.layers.attention import AttentionBackend
from cadence.layers.forward_batch import ForwardBatch
from cadence.layers.layer_ops import LayerOps


class TritonBackend(AttentionBackend):
    """Paged attention straight from the pool, for decode, verify steps and prefill alike:
    every query row attends to its request's keys up to its own position, read through the
    request's page table (`ForwardBatch.page_table`, which the runner fills for prefill too:
    `needs_page_table`). The new K/V are stored by the rotary kernel first, so a prefill
    chunk reads its own keys from the pool like its cached prefix."""

    decode_reads_whole_pages = False
    decode_takes_drafts = True
    needs_page_table = True

    def __init__(self, kv_pool, num_heads, num_kv_heads, head_dim):
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim)
        self._blocks: tuple[ForwardBatch, torch.Tensor] | None = None  # this step's programs
        self._block_tokens = triton_ops.extend_block_tokens(num_heads, num_kv_heads)

    def forward_qkv(self, qkv, rope_factors, ops, layer_id, batch):
        buf = self.kv_pool.kv_buffer[layer_id]
        triton_ops.rope_and_store(qkv, rope_factors, buf, batch.out_cache_loc, self.num_heads)
        return self._attend(qkv, buf, batch)

    def forward(self, q, kv, layer_id, batch):
        """The unfused entry (q already rotated): store, then attend."""
        buf = self.kv_pool.kv_buffer[layer_id]
        buf.view(-1, self.head_dim).index_copy_(
            0, batch.kv_write_rows, kv.reshape(-1, self.head_dim)
        )
        return self._attend(q, buf, batch)

    def _attend(self, q, buf, batch: ForwardBatch) -> torch.Tensor:
        blocks = None
        if not batch.is_decode or batch.query_starts is not None:
            if self._blocks is None or self._blocks[0] is not batch:  # once per step
                lens = batch.extend_lens
                self._blocks = (
                    batch,
                    triton_ops.attention_blocks(lens, q.device, self._block_tokens),
                )
            blocks = self._blocks[1]
        return triton_ops.paged_attention(
            q, buf, batch.positions, batch.page_table, self.num_heads, blocks
        )

    def release_decode_state(self) -> None:
        self._blocks = None


class TritonOps(LayerOps):
    """`LayerOps` as Triton kernels: each op one launch, in float32 with a single rounding.

    The logits of a low-precision LM head are recomputed whole in float32 (one matmul
    against a float32 copy of the head's weight, made once), where the portable ops refine
    only the candidates near each row's maximum: that search reads its candidates back to
    the host, which a captured graph cannot do, and on a GPU the full product costs less."""

    def __init__(self) -> None:
        self._float_heads: dict[int, torch.Tensor] = {}

    def rms_norm(self, x, weight, eps):
        return triton_ops.rms_norm(x, weight, eps)

    def add_rms_norm_(self, residual, x, weight, eps):
        return triton_ops.rms_norm(x, weight, eps, residual=residual)

    def silu_and_mul(self, gate_up):
        return triton_ops.silu_and_mul(gate_up)

    def rope_factors(self, factors):
        return torch.view_as_real(factors)  # float32 [T, heads, D/2, 2], as rope_and_store takes

    def rotary_(self, qk, factors):  # the unfused path: the backend fuses rotary with the store
        rotated = torch.view_as_complex(qk.float().view(qk.shape[0], -1, factors.shape[2], 2))
        qk.copy_(
            torch.view_as_real(rotated.mul_(torch.view_as_complex(factors))).view(qk.shape[0], -1)
        )

    def refined_logits(self, logits, hidden, weight):
        key = weight.data_ptr()
        head = self._float_heads.get(key)
        if head is None:
            self._float_heads = {key: weight.float()}  # one head: a weight update replaces it
            head = self._float_heads[key]
        return F.linear(hidden.float(), head)
