"""Attention backends behind one interface; the platform picks which one the model gets."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from cadence.layers.forward_batch import ForwardBatch
from cadence.mem_cache.kv_pool import KVPool


class AttentionBackend(ABC):
    """Computes attention for one layer given this step's new q/k/v.

    Invariants: `forward` first stores the new K/V at `batch.out_cache_loc` in the pool,
    then attends over each request's whole sequence (prefix + new). It reads only the KV
    slots listed for that request, so slots shared with other requests are never written.
    """

    def __init__(self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int):
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, H*D]; kv: [T, 2, KVH, D] (K then V). Returns [T, H*D]."""


class TorchSDPABackend(AttentionBackend):
    """Portable backend on torch's scaled_dot_product_attention (the CPU default)."""

    def forward(self, q, kv, layer_id, batch):
        buf = self.kv_pool.kv_buffer[layer_id]
        buf[batch.out_cache_loc] = kv
        if batch.is_decode:
            return self._decode(q, buf, batch)
        return self._extend(q, kv, buf, batch)

    def _decode(self, q, buf, batch):
        bs = batch.batch_size
        gathered = buf[batch.kv_indices]  # [B, L, 2, KVH, D]
        k = gathered[:, :, 0].transpose(1, 2)
        v = gathered[:, :, 1].transpose(1, 2)
        qh = q.view(bs, 1, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qh, k, v, attn_mask=batch.kv_mask, scale=self.scale, enable_gqa=True
        )
        return out.reshape(bs, self.num_heads * self.head_dim)

    def _extend(self, q, kv, buf, batch):
        out = torch.empty_like(q)
        start = 0
        for i, ext in enumerate(batch.extend_lens):
            prefix = batch.prefix_lens[i]
            qh = q[start : start + ext].view(ext, self.num_heads, self.head_dim).transpose(0, 1)
            if prefix == 0:
                seq_kv = kv[start : start + ext]  # the new tokens are the whole sequence
                mask, causal = None, True
            else:
                seq_kv = buf[batch.seq_kv_indices[i]]
                total = prefix + ext
                rows = torch.arange(prefix, total, device=q.device)[:, None]
                mask = torch.arange(total, device=q.device)[None, :] <= rows  # [ext, total]
                causal = False
            k = seq_kv[:, 0].transpose(0, 1)
            v = seq_kv[:, 1].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )
            out[start : start + ext] = o.transpose(0, 1).reshape(ext, -1)
            start += ext
        return out
