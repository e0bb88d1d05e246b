"""What one forward step needs to know about its batch, prepared once and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.layers.lora import LoraBatch


@dataclass
class ForwardBatch:
    """Flat token layout: the new tokens of every request, concatenated in batch order.

    Decode steps have one new token per request, or, in a verify step (`query_starts`), a
    request's last token and its drafted ones; extend (prefill) steps have `extend_lens[i]`
    new tokens for request i on top of `prefix_lens[i]` tokens whose K/V are already in the
    pool.
    """

    is_decode: bool
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each new token in its sequence
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each new token writes
    kv_write_rows: torch.Tensor  # [num_tokens * 2 * kv_heads] int64, see KVPool.write_rows
    seq_lens: list[int]  # per request: prefix + new tokens
    extend_lens: list[int]  # per request: new tokens this step (all 1 in decode)
    prefix_lens: list[int]  # per request: tokens already in the KV pool
    page_table: torch.Tensor | None = (
        None  # decode: [batch, max_pages] int64 page ids, short rows padded
    )
    kv_lens: torch.Tensor | None = None  # decode: [batch] int64, seq_lens as a tensor
    page_rows: torch.Tensor | None = (
        None  # decode: KVPool.page_rows of the [batch, max_pages] padded page table
    )
    # decode: [1, batch, 1, max_pages * page_size] bool, True = past the sequence; None if nothing is
    kv_mask: torch.Tensor | None = None
    # decode: the previous decode step ran exactly these requests, in this order, each one token
    # shorter (their K/V in the pool changed since only by this step's tokens)
    decode_continues: bool = False
    seq_page_rows: list[torch.Tensor | None] | None = (
        None  # extend: per request with a prefix, KVPool.page_rows of its pages
    )
    # decode with drafts: [batch + 1] int64, request i's rows are query_starts[i] to
    # query_starts[i + 1] (each attends to its sequence up to itself); None: one row each
    query_starts: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = (
        None  # [num_logit_rows] int64 rows of the flat tokens to project
    )
    lora: LoraBatch | None = None  # the adapters of the step's requests; None: no request has one

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)
