"""Paged KV memory: the K/V tensors, a page allocator with reference counts, and the
per-request table that maps each token position to its KV slot.

A page holds `page_size` consecutive token slots. Pages are reference counted so that a
prefix cache can share one page between several requests: a page returns to the free list
only when its last holder releases it.
"""

from __future__ import annotations

import torch


class KVPool:
    """K/V storage for every layer: kv_buffer[layer] is [2, num_kv_heads, num_pages, page_size,
    head_dim] (K then V).

    Head-major, so gathering a batch's pages along the page dimension gives [2, heads, batch,
    length, head_dim] blocks that batched matmuls take without another copy; and paged, so each
    gathered index moves a whole page (one large memcpy) rather than one token. A token's slot
    is `page * page_size + offset`.
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        if num_pages < 1:
            raise ValueError("max_total_tokens is too small to hold a single KV page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        self.device = device
        # torch.empty does not touch the memory: pages are faulted in only when written.
        shape = (2, num_kv_heads, num_pages, page_size, head_dim)
        self.kv_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Row offset of each (K/V, head) plane in a layer's flat [-1, head_dim] view.
        self._planes = torch.arange(2 * num_kv_heads, dtype=torch.int64, device=device) * self.num_slots

    def write_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the flat [-1, head_dim] view of a layer's buffer where tokens at `slots`
        keep their K and V heads: [len(slots) * 2 * heads], in (token, K/V, head) order —
        the order of a [tokens, 2, heads, head_dim] K/V tensor."""
        return (slots.unsqueeze(1) + self._planes).reshape(-1)

    def page_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Rows of the [-1, page_size * head_dim] view of a layer's buffer holding these pages,
        for every (K/V, head) plane: gathering them gives [2, heads, len(pages) * page_size,
        head_dim]. One index_select over dim 0 of that view moves whole pages with memcpy."""
        return (self._planes.unsqueeze(1) // self.page_size + pages.reshape(1, -1)).reshape(-1)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PageAllocator:
    """Hands out KV pages; the scheduler thread is its only user (no locking).

    Invariants: a page is either free (refcount 0, in the free list) or held (refcount ≥ 1,
    not in the free list). `num_free_pages + held pages == num_pages` at all times.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        # Pop from the end: low page ids first, which keeps a fresh request's pages contiguous.
        self.free_pages = list(range(num_pages - 1, -1, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def alloc(self, num: int) -> list[int] | None:
        """Take `num` free pages (refcount 1 each), or None when there are not enough."""
        if num > len(self.free_pages):
            return None
        pages = [self.free_pages.pop() for _ in range(num)]
        for p in pages:
            self.ref_counts[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref_counts[p] <= 0:
                raise RuntimeError(f"incref of free KV page {p}")
            self.ref_counts[p] += 1

    def decref(self, pages: list[int]) -> None:
        """Release one hold on each page; pages nobody holds return to the free list."""
        for p in pages:
            count = self.ref_counts[p]
            if count <= 0:
                raise RuntimeError(f"double free of KV page {p}")
            self.ref_counts[p] = count - 1
            if count == 1:
                self.free_pages.append(p)


class ReqToTokenPool:
    """Rows of KV slot indices, one row per running request: row[pos] = slot of token `pos`.

    Kept as one tensor so a decode step gathers every request's slot list with a single
    index operation instead of rebuilding Python lists each step.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.table = torch.zeros(max_reqs, max_context_len, dtype=torch.int64, device=device)
        self.free_rows = list(range(max_reqs - 1, -1, -1))
        self.max_reqs = max_reqs

    @property
    def num_free_rows(self) -> int:
        return len(self.free_rows)

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)
