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
    """Portable backend on torch matmuls and scaled_dot_product_attention (the CPU default)."""

    def forward(self, q, kv, layer_id, batch):
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        kv = kv.to(k_buf.dtype)
        k_buf[:, batch.out_cache_loc] = kv[:, 0].transpose(0, 1)
        v_buf[:, batch.out_cache_loc] = kv[:, 1].transpose(0, 1)
        if batch.is_decode:
            return self._decode(q.to(k_buf.dtype), k_buf, v_buf, batch).to(q.dtype)
        return self._extend(q.to(k_buf.dtype), kv, k_buf, v_buf, batch).to(q.dtype)

    def _decode(self, q, k_buf, v_buf, batch):
        # One query token per request: two batched matmuls over [KVH, B] beat the flash kernel.
        bs, kvh, d = batch.batch_size, self.num_kv_heads, self.head_dim
        group = self.num_heads // kvh
        k = k_buf[:, batch.kv_indices]  # [KVH, B, L, D]
        v = v_buf[:, batch.kv_indices]
        qg = q.view(bs, kvh, group, d).transpose(0, 1)  # [KVH, B, G, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(self.scale)  # [KVH, B, G, L]
        if batch.kv_mask is not None:
            scores.masked_fill_(batch.kv_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [KVH, B, G, D]
        return out.transpose(0, 1).reshape(bs, self.num_heads * d)

    def _extend(self, q, kv, k_buf, v_buf, batch):
        out = torch.empty_like(q)
        start = 0
        for i, ext in enumerate(batch.extend_lens):
            prefix = batch.prefix_lens[i]
            qh = q[start : start + ext].view(ext, self.num_heads, self.head_dim).transpose(0, 1)
            if prefix == 0:
                # The new tokens are the whole sequence: attend to them directly.
                k = kv[start : start + ext, 0].transpose(0, 1)
                v = kv[start : start + ext, 1].transpose(0, 1)
                mask, causal = None, True
            else:
                idx = batch.seq_kv_indices[i]
                k, v = k_buf[:, idx], v_buf[:, idx]  # [KVH, L, D]
                total = prefix + ext
                rows = torch.arange(prefix, total, device=q.device)[:, None]
                mask = torch.arange(total, device=q.device)[None, :] <= rows  # [ext, total]
                causal = False
            o = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )
            out[start : start + ext] = o.transpose(0, 1).reshape(ext, -1)
            start += ext
        return out
