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
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

from cadence.mem_cache.allocator import KVAllocator
from cadence.mem_cache.disk_tier import DiskTier
from cadence.mem_cache.kv_events import KVEventRecorder, chain_digests, namespace_seed


@dataclass(eq=False)
class Node:
    """A run of whole pages: `key` their tokens (len(key) == len(pages) * page_size)."""

    key: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # by first page's tokens
    lock_ref: int = 0  # holders (requests, sessions) that need this node and its ancestors kept
    last_access: int = 0  # the cache's tick when it was last matched or inserted (LRU order)
    # With KV events or the disk tier on: each page's chained SHA-256 digest (a root: its
    # namespace's seed).
    digests: list[bytes] = field(default_factory=list)
    namespace: int | None = None  # whose KV (a LoRA adapter's uid; None: the base model's)


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
    - Only the KV manager (`kv_manager.py`) calls the cache, on the scheduler's thread,
      between forward steps (no locking).
    """

    page_size: int
    version: int = 0  # grows whenever the cached content changes (insert, evict, reset)

    @abstractmethod
    def match_prefix(
        self, tokens: list[int], namespace: int | None = None
    ) -> tuple[list[int], Node | None]:
        """The pages of the longest cached whole-page prefix of `tokens`, and the node that
        ends it (None when nothing matched). Marks the path as used (LRU). KV computed in one
        `namespace` (a LoRA adapter's; None: the base model's) is never matched in another."""

    @abstractmethod
    def insert(
        self, tokens: list[int], pages: list[int], namespace: int | None = None
    ) -> Node | None:
        """Stores the whole pages of `tokens` (len(tokens) == len(pages) * page_size) in
        `namespace`; takes a hold on each page it did not have. Returns the node that ends
        the prefix."""

    @abstractmethod
    def lock(self, node: Node | None) -> None:
        """Keeps `node` and its ancestors from being evicted (counted: unlock as many times)."""

    @abstractmethod
    def unlock(self, node: Node | None) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Frees at least `num_pages` pages of unlocked nodes, least recently used first
        (whole nodes, so possibly a few more), or every evictable page when there are fewer;
        returns how many it freed."""

    def reset(self) -> None:
        """Drops every unlocked page (flush)."""

    def nodes(self) -> Iterator[Node]:
        """Every node of the tree but the root (none for a cache that keeps nothing)."""
        return iter(())

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

    def match_prefix(self, tokens, namespace=None):
        return [], None

    def insert(self, tokens, pages, namespace=None):
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
    """The radix tree over whole pages.

    Eviction pops the least recently used evictable leaf from a heap kept across calls, so
    `evict` costs O(k log n) for k dropped nodes: no walk of the tree, no sort per node. An
    entry is pushed whenever a node may have become an evictable leaf (inserted, unlocked to
    zero, its last child dropped) and checked only when popped (lazy deletion): one that left
    the tree, got locked or gained a child is discarded (an event pushes it again when it
    qualifies), one matched since it was pushed goes back with its new time. Times are a
    counter, so the order is exact. The heap is rebuilt from the tree when stale entries
    outnumber the nodes (amortized O(1) a push).
    """

    def __init__(
        self,
        allocator: KVAllocator,
        events: KVEventRecorder | None = None,
        disk: DiskTier | None = None,
        write_through: bool = True,
    ):
        self.allocator = allocator
        self.events = events  # records every change for KV-event subscribers, when given
        # The disk tier below memory: the base model's pages are written there as they are
        # inserted (write_through) or as they are evicted (write_back).
        self.disk = disk
        self.write_through = write_through
        self.page_size = allocator.page_size
        self.root = Node()
        self.root.lock_ref = 1  # never evicted
        # One tree per namespace (a LoRA adapter's KV differs from the base model's for the
        # same tokens); a root has no parent, as a node out of the tree has none.
        self._roots: dict[int | None, Node] = {None: self.root}
        self._num_cached = 0  # pages stored in the tree
        self._num_locked = 0  # pages of locked nodes (not evictable)
        self._num_nodes = 0  # nodes in the tree, the root aside
        self._tick = 0  # the LRU clock: grows by one every match and insert
        self._heap: list[tuple[int, int, Node]] = []  # (last_access, push order, node)
        self._pushes = itertools.count()  # breaks ties between equal times: first pushed first

    # ---- lookups ---------------------------------------------------------------------

    def match_prefix(
        self, tokens: list[int], namespace: int | None = None
    ) -> tuple[list[int], Node | None]:
        node, pages, page = self._roots.get(namespace), [], self.page_size
        if node is None:
            return [], None
        now = self._next_tick()
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

    def insert(
        self, tokens: list[int], pages: list[int], namespace: int | None = None
    ) -> Node | None:
        page = self.page_size
        if len(tokens) != len(pages) * page:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} whole pages")
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = Node(lock_ref=1, namespace=namespace)
            seed = namespace_seed(namespace)
            node.digests = [seed] if seed is not None else []
        pos, now = 0, self._next_tick()
        while pos < len(tokens):
            first = tuple(tokens[pos : pos + page])
            child = node.children.get(first)
            if child is None:
                new = Node(tuple(tokens[pos:]), list(pages[pos // page :]), node,
                           last_access=now, namespace=namespace)  # fmt: skip
                if self.events is not None or self.disk is not None:
                    self._record_stored(new, namespace)
                self.allocator.incref(new.pages)
                self._num_cached += len(new.pages)
                self._num_nodes += 1
                self.version += 1
                node.children[first] = new
                self._push(new)
                return new
            num = _common_pages(child.key, tokens, pos, page)
            if num < len(child.pages):
                child = self._split(child, num)
            child.last_access = now
            pos += len(child.key)
            node = child
        return node if node.parent is not None else None

    # ---- holds -------------------------------------------------------------------------

    def lock(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._num_locked += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a prefix-cache node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked -= len(node.pages)
                if not node.children:
                    self._push(node)
            node = node.parent

    # ---- freeing -----------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        freed = 0
        while freed < num_pages and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node):
                continue  # locked, grown or gone since it was pushed
            if stamp != node.last_access:
                self._push(node)  # matched since: back in line at its new time
                continue
            parent = node.parent
            freed += self._drop(node)
            if parent is not None and self._is_evictable_leaf(parent):
                self._push(parent)  # its last child went: it is a leaf now
        return freed

    def reset(self) -> None:
        self.evict(self._num_cached)
        if self.events is not None and self._num_cached == 0:
            self.events.cleared()

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached

    @property
    def num_evictable_pages(self) -> int:
        return self._num_cached - self._num_locked

    def nodes(self) -> Iterator[Node]:
        stack = [node for root in self._roots.values() for node in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- internals ---------------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _is_evictable_leaf(self, node: Node) -> bool:
        """Unlocked, childless and still in the tree (`_drop` clears a node's parent)."""
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._pushes), node))
        if len(self._heap) > 2 * self._num_nodes + 64:  # mostly stale entries: start afresh
            self._heap = [
                (n.last_access, next(self._pushes), n)
                for n in self.nodes()
                if self._is_evictable_leaf(n)
            ]
            heapq.heapify(self._heap)

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cuts `node` after `num_pages` pages; returns the new first part (a parent of the rest)."""
        parent = node.parent
        if parent is None:
            raise RuntimeError("prefix cache: splitting a node that is not in the tree")
        cut = num_pages * self.page_size
        head = Node(node.key[:cut], node.pages[:num_pages], parent, lock_ref=node.lock_ref,
                    last_access=node.last_access, digests=node.digests[:num_pages],
                    namespace=node.namespace)  # fmt: skip
        node.digests = node.digests[num_pages:]
        parent.children[node.key[: self.page_size]] = head
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], head
        head.children[node.key[: self.page_size]] = node
        self._num_nodes += 1
        return head

    def _drop(self, node: Node) -> int:
        parent = node.parent
        key = node.key[: self.page_size]
        if parent is None or parent.children.get(key) is not node:
            raise RuntimeError("prefix cache: dropping a node that is not in the tree")
        self.version += 1
        if self.disk is not None and not self.write_through and node.namespace is None:
            self.disk.store(node.digests, node.pages)  # write_back: kept below memory
        del parent.children[key]
        node.parent = None  # out of the tree: its heap entries are stale
        self.allocator.decref(node.pages)
        self._num_cached -= len(node.pages)
        self._num_nodes -= 1
        if self.events is not None:
            self.events.removed(node.digests)
        return len(node.pages)

    def _record_stored(self, node: Node, namespace: int | None) -> None:
        parent, events = node.parent, self.events
        if parent is None:
            return
        chain_from = parent.digests[-1] if parent.digests else None
        node.digests = chain_digests(chain_from, node.key, self.page_size)
        if events is not None:
            # Under a root the event names no parent (a namespace's seed is no page).
            shown_parent = chain_from if parent.parent is not None else None
            events.stored(node.digests, shown_parent, node.key, namespace)
        if self.disk is not None and self.write_through and namespace is None:
            self.disk.store(node.digests, node.pages)

    def write_back_all(self) -> None:
        """write_back at a clean stop: what memory still caches goes to the disk tier too,
        so that a restart finds it (write_through wrote it already)."""
        if self.disk is None or self.write_through:
            return
        for node in self.nodes():
            if node.namespace is None and node.digests:
                self.disk.store(node.digests, node.pages)

    def chain_after(self, node: Node | None, tokens: list[int], namespace: int | None = None):
        """Digests of the whole pages of `tokens`, which follow `node` (None: the root of
        `namespace`) in the tree: where the disk tier finds them."""
        if node is not None:
            start = node.digests[-1] if node.digests else None
        else:
            root = self._roots.get(namespace)
            start = root.digests[-1] if root is not None and root.digests else None
        return chain_digests(start, tokens, self.page_size)


def _common_pages(key: tuple[int, ...], tokens: list[int], pos: int, page: int) -> int:
    """Whole pages of `key` equal to tokens[pos:], page by page."""
    num = 0
    while (num + 1) * page <= len(key) and pos + (num + 1) * page <= len(tokens):
        start = num * page
        if key[start : start + page] != tuple(tokens[pos + start : pos + start + page]):
            break
        num += 1
    return num
