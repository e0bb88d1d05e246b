"""The prefix cache: KV pages kept after their request ends, found again by token ids.

Every finished (and every fully prefilled) request leaves its KV in a radix tree over token
ids, page by page; a new request that starts with the same tokens (a system prompt, the
earlier turns of a chat, an agent's growing transcript) takes those pages and prefills only
the rest. `RadixCache` is the tree; `NoPrefixCache` keeps nothing (--disable-radix-cache).

Sharing is page-granular: only whole pages are cached and matched. A request's partial last
page is never shared; a request that matches part of a page recomputes that part.
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from cadence.mem_cache.allocator import KVAllocator


@dataclass(eq=False)
class Node:
    """A run of whole pages: `key` their tokens (len(key) == len(pages) * page_size)."""

    key: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # by first page's tokens
    lock_ref: int = 0  # holders (requests, sessions) that need this node and its ancestors kept
    last_access: float = 0.0


class PrefixCache(ABC):
    """A cache of KV pages by token-id prefix, over a `KVAllocator`.

    Invariants:
    - The cache holds one allocator hold on every page it stores; `evict` and `reset` give
      them back. A request that uses matched pages takes its own holds (`incref`) and
      releases them itself.
    - A locked node (and every ancestor of it) is never evicted. Callers lock the node
      `match_prefix`/`insert` returned before they use its pages, and unlock it when done.
    - `num_evictable_pages` counts the pages `evict` could free now: those of unlocked nodes
      that no request holds any more. So free + evictable + in use == the pool, always.
    - Only the scheduler's thread calls the cache (no locking), between forward steps.
    """

    page_size: int
    version: int = 0  # grows whenever the cached content changes (insert, evict, reset)

    @abstractmethod
    def match_prefix(self, tokens: list[int]) -> tuple[list[int], Node | None]:
        """The pages of the longest cached whole-page prefix of `tokens`, and the node that
        ends it (None when nothing matched). Marks the path as used (LRU)."""

    @abstractmethod
    def insert(self, tokens: list[int], pages: list[int]) -> Node | None:
        """Stores the whole pages of `tokens` (len(tokens) == len(pages) * page_size); takes
        a hold on each page it did not have. Returns the node that ends the prefix."""

    @abstractmethod
    def lock(self, node: Node | None) -> None:
        """Keeps `node` and its ancestors from being evicted (counted: unlock as many times)."""

    @abstractmethod
    def unlock(self, node: Node | None) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        freed = 0
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += self._drop(leaf)
            if parent is not self.root and self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    @staticmethod
    def _is_evictable_leaf(node: Node) -> bool:
        return not node.children and node.lock_ref == 0

    def reset(self) -> None:
        """Drops every unlocked page (flush)."""

    @property
    @abstractmethod
    def num_cached_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int: ...


class NoPrefixCache(PrefixCache):
    """Keeps nothing: every request prefills its whole prompt."""

    def __init__(self, page_size: int):
        self.page_size = page_size

    def match_prefix(self, tokens):
        return [], None

    def insert(self, tokens, pages):
        return None

    def lock(self, node):
        pass

    def unlock(self, node):
        pass

    def evict(self, num_pages):
        return 0

    def reset(self):
        pass

    num_cached_pages = 0
    num_evictable_pages = 0


class RadixCache(PrefixCache):
    def __init__(self, allocator: KVAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = Node()
        self.root.lock_ref = 1  # never evicted
        self._num_cached = 0  # pages stored in the tree
        self._num_locked = 0  # pages of locked nodes (not evictable)

    # ---- lookups ---------------------------------------------------------------------

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], Node | None]:
        node, pages, page = self.root, [], self.page_size
        now = time.monotonic()
        pos = 0
        while pos + page <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + page]))
            if child is None:
                break
            num = _common_pages(child.key, tokens, pos, page)
            if num < len(child.pages):
                child = self._split(child, num)
            child.last_access = now
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return pages, (node if pages else None)

    def insert(self, tokens: list[int], pages: list[int]) -> Node | None:
        page = self.page_size
        if len(tokens) != len(pages) * page:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} whole pages")
        node, pos, now = self.root, 0, time.monotonic()
        while pos < len(tokens):
            first = tuple(tokens[pos : pos + page])
            child = node.children.get(first)
            if child is None:
                new = Node(tuple(tokens[pos:]), list(pages[pos // page :]), node, last_access=now)
                self.allocator.incref(new.pages)
                self._num_cached += len(new.pages)
                self.version += 1
                node.children[first] = new
                return new
            num = _common_pages(child.key, tokens, pos, page)
            if num < len(child.pages):
                child = self._split(child, num)
            child.last_access = now
            pos += len(child.key)
            node = child
        return node if node is not self.root else None

    # ---- holds -------------------------------------------------------------------------

    def lock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._num_locked += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a prefix-cache node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked -= len(node.pages)
            node = node.parent

    # ---- freeing -----------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        freed = 0
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        while freed < num_pages and leaves:
            leaves.sort(key=lambda n: n.last_access)
            leaf = leaves.pop(0)
            freed += self._drop(leaf)
            parent = leaf.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                leaves.append(parent)
        return freed

    def reset(self) -> None:
        self.evict(self._num_cached)

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached

    @property
    def num_evictable_pages(self) -> int:
        return self._num_cached - self._num_locked

    # ---- internals ---------------------------------------------------------------------

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cuts `node` after `num_pages` pages; returns the new first part (a parent of the rest)."""
        cut = num_pages * self.page_size
        head = Node(node.key[:cut], node.pages[:num_pages], node.parent, lock_ref=node.lock_ref,
                    last_access=node.last_access)  # fmt: skip
        node.parent.children[node.key[: self.page_size]] = head
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], head
        head.children[node.key[: self.page_size]] = node
        return head

    def _drop(self, node: Node) -> int:
        self.version += 1
        siblings = node.parent.children
        key = node.key[: self.page_size]
        if siblings.get(key) is not node:
            raise RuntimeError("prefix cache: dropping a node that is not in the tree")
        del siblings[key]
        self.allocator.decref(node.pages)
        self._num_cached -= len(node.pages)
        return len(node.pages)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_pages(key: tuple[int, ...], tokens: list[int], pos: int, page: int) -> int:
    """Whole pages of `key` equal to tokens[pos:], page by page."""
    num = 0
    while (num + 1) * page <= len(key) and pos + (num + 1) * page <= len(tokens):
        start = num * page
        if key[start : start + page] != tuple(tokens[pos + start : pos + start + page]):
            break
        num += 1
    return num
