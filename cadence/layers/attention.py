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
    pages listed for that request, so pages shared with other requests are never written.
    Queries arrive already multiplied by the softmax scale.
    """

    decode_reads_whole_pages: bool = True
    """Decode reads each request's pages whole and masks the slots past its length, so it needs
    `ForwardBatch.page_rows` and `kv_mask`, and freshly allocated pages zeroed (a masked slot
    still multiplies its V by 0, and stale memory could hold NaN). False for a backend that
    reads only each sequence's own slots; the runner then skips all three."""

    decode_takes_drafts: bool = False
    """Decode takes several rows per request (`ForwardBatch.query_starts`: a verify step's
    drafted tokens, causal among themselves). Without it, the runner verifies drafts as a
    prefill over each request's cached prefix."""

    needs_page_table: bool = False
    """Prefill reads the prefix through `ForwardBatch.page_table` (each request's pages, as in
    decode) rather than `seq_page_rows`; the runner fills the one the backend reads."""

    def __init__(self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int):
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @abstractmethod
    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H*D]; kv: [T, 2, KVH, D] (K then V), both in the pool's dtype. Returns [T, H*D]."""

    def forward_qkv(
        self, qkv: torch.Tensor, rope_factors, ops, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """The layer's entry: qkv [T, (H + 2 KVH) * D] is this step's projections, q and k not yet
        rotated, in the pool's dtype. Rotates q and k in place (`ops.rotary_`, `rope_factors` in
        the form `ops.rope_factors` gave), then `forward`. A backend may fuse all of it."""
        t, q_dim = qkv.shape[0], self.num_heads * self.head_dim
        ops.rotary_(qkv[:, : q_dim + self.num_kv_heads * self.head_dim], rope_factors)
        kv = qkv[:, q_dim:].view(t, 2, self.num_kv_heads, self.head_dim)
        return self.forward(qkv[:, :q_dim], kv, layer_id, batch)

    def release_decode_state(self) -> None:
        """Drops anything kept from one decode step for the next (the running batch is empty)."""

    def decode_state_bytes(self) -> int:
        """Memory held by what `release_decode_state` drops."""
        return 0


class TorchNativeBackend(AttentionBackend):
    """Portable backend on torch matmuls and scaled_dot_product_attention (CUDA's, and the CPU's
    where Cadence's CPU kernels cannot be built).

    Decode keeps, per layer, the batch's pages gathered into one [2, KVH, B, W, D] block (the
    "decode block", W = the padded page table's width in tokens) and, while the next step runs
    the same requests one token longer over the same width (`ForwardBatch.decode_continues`),
    only writes the new token into it. A gather, which copies the whole batch's K/V, now
    happens only when the batch changes or its longest sequence crosses a page boundary
    (batch 32 decodes ~9% faster than gathering every step).
    """

    decode_takes_drafts = True

    FLOAT32_DECODE_TOKENS = (
        1024  # decode attention over at most this many KV tokens runs in float32
    )
    DECODE_BLOCK_BYTES = 512 << 20  # decode blocks are kept only while all layers' fit in this

    def __init__(self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim)
        self._blocks: list[torch.Tensor | None] = [None] * len(kv_pool.kv_buffer)
        self._block_rows: tuple[ForwardBatch, torch.Tensor] | None = None  # this step's write rows

    def forward(self, q, kv, layer_id, batch):
        buf = self.kv_pool.kv_buffer[layer_id]  # [2, KVH, pages, page, D]
        # index_copy_ on a flat view is an order of magnitude faster than advanced indexing.
        buf.view(-1, self.head_dim).index_copy_(
            0, batch.kv_write_rows, kv.reshape(-1, self.head_dim)
        )
        if batch.is_decode:
            return self._decode(q, self._decode_block(kv, buf, layer_id, batch), batch)
        return self._extend(q, kv, buf, batch)

    def release_decode_state(self) -> None:
        self._blocks = [None] * len(self._blocks)
        self._block_rows = None

    def decode_state_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._blocks if b is not None)

    def _decode_block(self, kv, buf, layer_id: int, batch) -> torch.Tensor:
        """This layer's [2, KVH, B, W, D] K/V of the decode batch, this step's token included
        (float32 for batches small enough to attend in float32)."""
        bs, kvh, d = batch.batch_size, self.num_kv_heads, self.head_dim
        width = batch.page_rows.numel() // (2 * kvh * bs) * buf.shape[3]  # padded table, in tokens
        block = self._blocks[layer_id]
        if batch.decode_continues and block is not None and block.shape[2:4] == (bs, width):
            if self._block_rows is None or self._block_rows[0] is not batch:
                # Row of each (request, K/V, head) in the block's flat [-1, D] view, in kv's order.
                last = torch.tensor(batch.seq_lens, dtype=torch.int64, device=kv.device) - 1
                planes = torch.arange(2 * kvh, dtype=torch.int64, device=kv.device) * (bs * width)
                rows = planes.unsqueeze(0) + (
                    torch.arange(bs, device=kv.device) * width + last
                ).unsqueeze(1)
                self._block_rows = (batch, rows.reshape(-1))
            block.view(-1, d).index_copy_(0, self._block_rows[1], kv.reshape(-1, d).to(block.dtype))
            return block
        block = self._gather(buf, batch.page_rows).view(2, kvh, bs, width, d)
        if bs * width <= self.FLOAT32_DECODE_TOKENS:
            block = block.float()  # kept in the dtype its matmuls run in (see _decode)
        keep = block.numel() * block.element_size() * len(self._blocks) <= self.DECODE_BLOCK_BYTES
        self._blocks[layer_id] = block if keep else None
        return block

    def _gather(self, buf, page_rows: torch.Tensor) -> torch.Tensor:
        """K and V on the pages of `KVPool.page_rows`, in order: [2, KVH, pages * page_size, D]."""
        pages = buf.view(-1, buf.shape[3] * self.head_dim)  # one whole page per row
        return pages.index_select(0, page_rows).view(2, self.num_kv_heads, -1, self.head_dim)

    def _decode(self, q, kv, batch):
        if batch.query_starts is not None:
            return self._decode_drafts(q, kv, batch)
        # One query token per request: two batched matmuls over [KVH, B] beat the flash kernel.
        bs, kvh, d = batch.batch_size, self.num_kv_heads, self.head_dim
        # kv: [2, KVH, B, W, D], whole pages, slots past each sequence masked. Not cut to the longest
        # sequence: a cut block is no longer one strided batch, and the matmul would copy it.
        # Small batches attend in float32 (their block is kept in float32): a CPU bfloat16
        # batched matmul has a fixed cost of ~20 us at these shapes (a few query rows per
        # head), float32 half that. Past about a thousand tokens bfloat16 is faster.
        qg = (
            q.view(bs, kvh, self.num_heads // kvh, d).transpose(0, 1).to(kv.dtype)
        )  # [KVH, B, G, D]
        scores = torch.matmul(qg, kv[0].transpose(-1, -2))  # [KVH, B, G, W]
        if batch.kv_mask is not None:
            scores.masked_fill_(batch.kv_mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), kv[1])  # [KVH, B, G, D]
        return out.transpose(0, 1).reshape(bs, self.num_heads * d)

    def _decode_drafts(self, q, kv, batch):
        """A verify step: request b's rows (its last token, then its drafts) padded to the
        most any request has, all attending in the same two matmuls over the decode block;
        row j of b sees the tokens before seq_len - (rows of b - 1 - j)."""
        bs, kvh, d = batch.batch_size, self.num_kv_heads, self.head_dim
        groups, width = self.num_heads // kvh, kv.shape[3]
        news = torch.tensor(batch.extend_lens, device=q.device)
        most = int(max(batch.extend_lens))
        j = torch.arange(most, device=q.device)
        real = j.unsqueeze(0) < news.unsqueeze(1)  # [B, most]: a request's rows, not padding
        padded = q.new_zeros(bs, most, self.num_heads * d)
        padded[real] = q
        qg = (
            padded.view(bs, most, kvh, groups, d).permute(2, 0, 1, 3, 4).reshape(kvh, bs, -1, d)
        ).to(kv.dtype)  # [KVH, B, most * G, D]
        scores = torch.matmul(qg, kv[0].transpose(-1, -2))  # [KVH, B, most * G, W]
        # Tokens row j sees: below kv_len - news + 1 + j (padding rows see as much as the last).
        limit = batch.kv_lens.unsqueeze(1) - news.unsqueeze(1) + 1 + j.unsqueeze(0)
        hidden = torch.arange(width, device=q.device).view(1, 1, -1) >= limit.unsqueeze(2)
        scores.masked_fill_(
            hidden.unsqueeze(2).expand(bs, most, groups, width).reshape(1, bs, -1, width),
            float("-inf"),
        )
        out = torch.matmul(torch.softmax(scores, dim=-1), kv[1])  # [KVH, B, most * G, D]
        out = out.view(kvh, bs, most, groups, d).permute(1, 2, 0, 3, 4)
        return out.reshape(bs, most, self.num_heads * d)[real]

    def _extend(self, q, kv, buf, batch):
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
                total = prefix + ext
                k, v = self._gather(buf, batch.seq_page_rows[i])[:, :, :total]
                rows = torch.arange(prefix, total, device=q.device)[:, None]
                mask = torch.arange(total, device=q.device)[None, :] <= rows  # [ext, total]
                causal = False
            # 4-D inputs keep SDPA on its fused CPU kernel; 3-D ones fall back to plain math (3x slower).
            o = F.scaled_dot_product_attention(
                qh[None],
                k[None],
                v[None],
                attn_mask=mask,
                is_causal=causal,
                scale=1.0,
                enable_gqa=True,
            )[0]
            out[start : start + ext] = o.transpose(0, 1).reshape(ext, -1)
            start += ext
        return out


class CpuPagedBackend(TorchNativeBackend):
    """Decode by one Cadence CPU kernel per layer: rotary on q and k, the new K/V stored in
    the pool, and attention reading each request's pages straight from the pool (no gathered
    copy, nothing kept between steps). Prefill, and `forward`, as `TorchNativeBackend`.

    The kernel scores each sequence only up to its length, so no mask and no padding enter
    the softmax; it accumulates in float32 whatever the pool's dtype.
    """

    decode_reads_whole_pages = False  # and prefill cuts its gathered prefix to the sequence

    def forward_qkv(self, qkv, rope_factors, ops, layer_id, batch):
        if not batch.is_decode:
            return super().forward_qkv(qkv, rope_factors, ops, layer_id, batch)
        if rope_factors.is_complex():  # the kernel takes rotary_'s float32 [T, heads, D/2, 2] form
            rope_factors = torch.view_as_real(rope_factors)
        return torch.ops.cadence.decode_attention.default(
            qkv,
            rope_factors,
            self.kv_pool.kv_buffer[layer_id],
            batch.out_cache_loc,
            batch.page_table,
            batch.kv_lens,
            self.num_heads,
            batch.query_starts,
        )
