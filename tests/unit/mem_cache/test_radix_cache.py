"""The radix prefix cache alone, over a real reference-counted allocator.

A Hypothesis state machine plays requests against the tree the way the scheduler does:
match a prompt, hold and lock what matched, allocate the rest, insert the computed pages,
release; with evictions and resets in between. After every step it checks that no page is
lost or double-counted, that free + cached-only + held-by-requests == the pool, that the
evictable count is exactly what eviction can free, and that a locked node is never evicted.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from cadence.mem_cache.allocator import PageAllocator
from cadence.mem_cache.prefix_cache import NoPrefixCache, RadixCache

PAGE = 2
POOL = 24

# Short token sequences over a tiny alphabet, so prompts share prefixes often.
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=12)


class Request:
    def __init__(self, ids, pages, node):
        self.ids, self.pages, self.node = ids, pages, node


class CacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(POOL, PAGE)
        self.cache = RadixCache(self.alloc)
        self.live: list[Request] = []

    @rule(target=requests, ids=tokens)
    def admit(self, ids):
        """Match, lock and hold the cached prefix; allocate (evicting if needed) the rest."""
        whole = len(ids) // PAGE * PAGE
        pages, node = self.cache.match_prefix(ids[:whole])
        assert len(pages) * PAGE <= whole
        assert (node is None) == (not pages)
        if pages:  # what matched is exactly a cached prefix of the prompt
            self._check_pages_hold(pages)
        self.cache.lock(node)
        need = self.alloc.pages_for(len(ids)) - len(pages)
        if need > self.alloc.num_free_pages + self.cache.num_evictable_pages:
            self.cache.unlock(node)
            return None
        short = need - self.alloc.num_free_pages
        if short > 0:
            assert self.cache.evict(short) >= short
        self.alloc.incref(pages)
        new = self.alloc.alloc(need)
        assert new is not None
        req = Request(ids, pages + new, node)
        self.live.append(req)
        return req

    @rule(req=requests)
    def insert_progress(self, req):
        """A computed whole-page prefix goes into the tree; the lock moves to its node."""
        if req is None or req not in self.live:
            return
        num = len(req.ids) // PAGE
        if num == 0:
            return
        node = self.cache.insert(req.ids[: num * PAGE], req.pages[:num])
        assert node is not None
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node
        got, _ = self.cache.match_prefix(req.ids[: num * PAGE])
        assert len(got) == num  # it is all cached now
        # As the scheduler does: where another request cached the same prefix first, take the
        # tree's pages and give back the duplicates.
        for i, page in enumerate(got):
            if req.pages[i] != page:
                self.alloc.incref([page])
                self.alloc.decref([req.pages[i]])
                req.pages[i] = page

    @rule(req=consumes(requests))
    def finish(self, req):
        if req is None or req not in self.live:
            return
        self.live.remove(req)
        self.cache.unlock(req.node)
        self.alloc.decref(req.pages)

    @rule(num=st.integers(1, POOL))
    def evict(self, num):
        locked = self._locked_pages()
        evictable = self.cache.num_evictable_pages
        free_before = self.alloc.num_free_pages
        freed = self.cache.evict(num)
        assert freed <= evictable
        assert freed >= min(num, evictable)
        assert self.alloc.num_free_pages == free_before + freed  # evicted pages are truly free
        assert locked <= self._cached_pages()  # nothing a request locked went away

    @rule()
    def reset(self):
        locked = self._locked_pages()
        self.cache.reset()
        assert self.cache.num_evictable_pages == 0
        assert self._cached_pages() == locked

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def pages_add_up(self):
        held = [p for r in self.live for p in r.pages]
        cached = self._cached_list()
        assert len(cached) == len(set(cached)) == self.cache.num_cached_pages
        refs = self.alloc.ref_counts
        for p in range(POOL):
            assert refs[p] == held.count(p) + cached.count(p), f"page {p}"
        cached_only = {p for p in cached if p not in held}
        in_use = set(held)
        assert self.alloc.num_free_pages + len(cached_only) + len(in_use) == POOL
        # evictable == what no live request needs: the cached pages no request holds
        assert self.cache.num_evictable_pages == len(cached_only)

    @invariant()
    def locked_nodes_are_in_the_tree(self):
        for r in self.live:
            node = r.node
            while node is not None and node is not self.cache.root:
                assert node.lock_ref > 0
                assert node.parent.children[node.key[:PAGE]] is node
                node = node.parent

    # ---- helpers ----------------------------------------------------------------------------

    def _cached_list(self) -> list[int]:
        return [p for n in self.cache.nodes() for p in n.pages]

    def _cached_pages(self) -> set[int]:
        return set(self._cached_list())

    def _locked_pages(self) -> set[int]:
        return {p for n in self.cache.nodes() if n.lock_ref > 0 for p in n.pages}

    def _check_pages_hold(self, pages):
        assert all(self.alloc.ref_counts[p] > 0 for p in pages)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_match_takes_whole_pages_only_and_splits_nodes():
    alloc = PageAllocator(8, 4)
    cache = RadixCache(alloc)
    pages = alloc.alloc(3)
    ids = list(range(12))
    cache.insert(ids, pages)
    alloc.decref(pages)  # only the cache holds them now
    assert cache.num_cached_pages == cache.num_evictable_pages == 3
    # A prompt that shares 6 tokens gets one page: the second is only half shared.
    got, node = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 99])
    assert got == pages[:1] and node.key == (0, 1, 2, 3)
    # The node was split at the page boundary; both halves are still one path.
    got, _ = cache.match_prefix(ids)
    assert got == pages
    # Evicting one page takes the least recently used leaf: the tail, not the shared head.
    cache.lock(node)
    assert cache.evict(3) == 2 and cache.num_cached_pages == 1
    assert cache.match_prefix(ids)[0] == pages[:1]
    cache.unlock(node)
    cache.reset()
    assert alloc.num_free_pages == 8


def test_lru_order_decides_what_goes_first():
    alloc = PageAllocator(8, 2)
    cache = RadixCache(alloc)
    for ids in ([1, 1], [2, 2], [3, 3]):
        p = alloc.alloc(1)
        cache.insert(ids, p)
        alloc.decref(p)
    cache.match_prefix([1, 1])  # touch the oldest: now [2, 2] is the least recently used
    assert cache.evict(1) == 1
    assert cache.match_prefix([2, 2])[0] == []
    assert cache.match_prefix([1, 1])[0] and cache.match_prefix([3, 3])[0]


def test_insert_refuses_a_partial_page_and_the_no_op_cache_keeps_nothing():
    alloc = PageAllocator(4, 4)
    cache = RadixCache(alloc)
    try:
        cache.insert([1, 2, 3], alloc.alloc(1))
    except ValueError:
        pass
    else:
        raise AssertionError("a partial page was accepted")
    none = NoPrefixCache(4)
    assert none.insert([1, 2, 3, 4], [0]) is None
    assert none.match_prefix([1, 2, 3, 4]) == ([], None)
    assert none.num_evictable_pages == none.num_cached_pages == 0


def test_eviction_takes_leaves_in_lru_order_one_call_or_many():
    def build():
        alloc = PageAllocator(16, 2)
        cache = RadixCache(alloc)
        for ids in ([1, 1, 2, 2], [1, 1, 3, 3], [5, 5], [6, 6], [7, 7]):
            cached, _ = cache.match_prefix(ids)
            pages = alloc.alloc(len(ids) // 2 - len(cached))
            cache.insert(ids, cached + pages)
            alloc.decref(pages)
        # [1,1] is split into a head with two children. Touch, oldest first: [6,6], then the
        # [1,1,3,3] branch (head and child at once); [1,1,2,2]'s tail, [5,5] and [7,7] are
        # left as they were inserted.
        cache.match_prefix([6, 6])
        cache.match_prefix([1, 1, 3, 3])
        return cache

    def gone(cache, before):
        left = {n.key for n in cache.nodes()}
        return sorted(before - left)

    expected = [(2, 2), (5, 5), (7, 7), (6, 6), (3, 3), (1, 1)]  # the head goes after its child
    cache = build()
    order = []
    for _ in expected:  # one page a call
        before = {n.key for n in cache.nodes()}
        assert cache.evict(1) == 1
        order.extend(gone(cache, before))
    assert order == expected and cache.num_cached_pages == 0
    cache = build()  # the same order within one call: the first three go, and only those
    assert cache.evict(3) == 3
    assert {n.key for n in cache.nodes()} == {(1, 1), (3, 3), (6, 6)}


def test_the_eviction_heap_stays_bounded_and_locked_leaves_are_skipped():
    alloc = PageAllocator(8, 2)
    cache = RadixCache(alloc)
    pages = alloc.alloc(2)
    node = cache.insert([1, 1, 2, 2], pages)
    alloc.decref(pages)
    for _ in range(1000):  # every unlock pushes the leaf again: stale entries are dropped
        cache.lock(node)
        cache.unlock(node)
    assert len(cache._heap) <= 2 * 1 + 64 + 1
    cache.lock(node)
    assert cache.evict(2) == 0 and cache.num_cached_pages == 2  # locked: nothing goes
    cache.unlock(node)
    assert cache.evict(2) == 2 and alloc.num_free_pages == 8
