"""Who holds which KV page: the allocator interface the scheduler borrows, and its
reference-counted implementation.

The scheduler decides which request gets which page; the model runner only reads the page
lists it is handed and writes K/V into those pages during a step. A prefix cache will hold
pages too (reference counts let one page serve several requests), so a page returns to the
free list only when its last holder releases it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class KVAllocator(ABC):
    """Hands out KV pages of one pool.

    Invariants:
    - A page is either free (no holder, handed out by `alloc`) or held by one or more
      holders (each `alloc` or `incref` is one hold; each `decref` releases one).
    - `num_free_pages + number of held pages == num_pages`, always.
    - Only the scheduler's thread mutates holds, and only between forward steps: a page
      given to a request for a step is not released before that step has run, so the
      runner never writes into a page someone else may have been given.
    - A freshly allocated page's contents are undefined (stale K/V of its last holder).
    """

    page_size: int  # token slots per page
    num_pages: int  # pages in the pool

    @property
    @abstractmethod
    def num_free_pages(self) -> int:
        """Pages no one holds."""

    @abstractmethod
    def alloc(self, num: int) -> list[int] | None:
        """Take `num` free pages (one hold each), or None, taking nothing, if there are fewer."""

    @abstractmethod
    def incref(self, pages: list[int]) -> None:
        """Add one hold to each of these held pages (sharing them)."""

    @abstractmethod
    def decref(self, pages: list[int]) -> None:
        """Release one hold on each page; a page with no holder left becomes free."""

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)


class PageAllocator(KVAllocator):
    """The reference-counted free list; the scheduler thread is its only user (no locking)."""

    def __init__(self, num_pages: int, page_size: int = 1):
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_counts = [0] * num_pages
        # Pop from the end: low page ids first, which keeps a fresh request's pages contiguous.
        self.free_pages = list(range(num_pages - 1, -1, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def alloc(self, num: int) -> list[int] | None:
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
        for p in pages:
            count = self.ref_counts[p]
            if count <= 0:
                raise RuntimeError(f"double free of KV page {p}")
            self.ref_counts[p] = count - 1
            if count == 1:
                self.free_pages.append(p)
