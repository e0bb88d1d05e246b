"""The KV manager alone, over a real reference-counted allocator and radix cache: admission
matches, locks, evicts and reserves all or nothing; growth stays within the reservation;
embedding steps never take pages promised to admitted requests; pins outlive their
request; and the books balance (`check`) after every call."""

from __future__ import annotations

import pytest

from cadence.mem_cache.allocator import PageAllocator
from cadence.mem_cache.kv_manager import KVHandle, KVManager
from cadence.mem_cache.prefix_cache import NoPrefixCache, RadixCache

PAGE = 2


def manager(num_pages: int, caching: bool = True) -> tuple[KVManager, PageAllocator]:
    alloc = PageAllocator(num_pages, PAGE)
    return KVManager.build(alloc, enable_prefix_cache=caching), alloc


def run_to_end(kv: KVManager, tokens: list[int], total: int) -> KVHandle:
    """Admits `tokens`, computes them (growing page by page) and caches them; the handle
    still holds its reservation for `total` tokens."""
    handle = kv.admit(tokens[: len(tokens) - 1 - (len(tokens) - 1) % PAGE], total)
    assert handle is not None
    kv.grow(handle, len(tokens))
    kv.cache_progress(handle, tokens)
    kv.check()
    return handle


def books(kv: KVManager, alloc: PageAllocator) -> tuple:
    """Everything a failed admission must leave as it was (the tree's shape aside: a match
    may split a node, which moves no page)."""
    cache = kv._cache
    locked = sorted(p for n in cache.nodes() if n.lock_ref > 0 for p in n.pages)
    cached = sorted(p for n in cache.nodes() for p in n.pages)
    return kv.usage(), sorted(alloc.free_pages), list(alloc.ref_counts), locked, cached


def test_admission_takes_the_cached_prefix_and_reserves_the_rest():
    kv, alloc = manager(16)
    first = run_to_end(kv, list(range(8)), 12)  # 4 pages computed, 6 reserved
    assert kv.usage().num_promised == 2
    kv.release(first)
    usage = kv.check()
    assert usage.num_in_use == 0 and usage.num_evictable == 4 and usage.num_promised == 0
    second = kv.admit(list(range(6)), 10)  # 3 pages cached of 5
    assert second is not None
    assert second.num_cached_tokens == 6 and len(second.pages) == 3 and second.num_reserved == 5
    usage = kv.check()
    assert usage.num_in_use == 3 and usage.num_promised == 2 and usage.num_evictable == 1
    assert kv.grow(second, 6) == []  # it has those pages
    assert len(kv.grow(second, 7)) == 1 and kv.check().num_promised == 1
    kv.release(second)
    kv.flush()
    assert kv.check().num_free == 16


def test_a_failed_admission_changes_nothing():
    kv, alloc = manager(10)
    cached = run_to_end(kv, [1] * 8, 8)  # 4 pages, then only the cache keeps them
    kv.release(cached)
    running = kv.admit([], 8)  # 4 pages promised, none taken yet
    assert running is not None
    before = books(kv, alloc)
    # 2 free beyond the promise + 4 evictable, but the prefix it matches (2 pages) is locked
    # by the attempt itself: 8 - 2 pages needed > 2 + 2 the pool can give.
    assert kv.admit([1] * 4, 16) is None
    assert books(kv, alloc) == before
    assert kv.admit([9] * 4, 14) is None  # nothing cached: 7 pages > 6
    assert books(kv, alloc) == before
    fits = kv.admit([1] * 4, 10)  # 2 cached + 3 new: evicts the unlocked tail (2 pages)
    assert fits is not None and fits.num_cached_tokens == 4
    usage = kv.check()
    assert usage.num_promised == 4 + 3 and usage.num_free >= usage.num_promised
    kv.release(fits)
    kv.release(running)
    kv.check()


def test_growth_past_the_reservation_and_a_second_release_are_bookkeeping_bugs():
    kv, _ = manager(8)
    handle = kv.admit([], 4)  # 2 pages
    assert handle is not None
    kv.grow(handle, 4)
    with pytest.raises(RuntimeError, match="reserved"):
        kv.grow(handle, 5)
    kv.release(handle)
    with pytest.raises(RuntimeError, match="released twice"):
        kv.release(handle)
    assert kv.check().num_free == 8


def test_embedding_steps_never_take_pages_promised_to_admitted_requests():
    kv, alloc = manager(8)
    gen = kv.admit([], 12)  # 6 pages promised, 1 taken by its first chunk
    assert gen is not None
    kv.grow(gen, 2)
    assert alloc.num_free_pages == 7  # 7 free pages, but 5 of them are promised
    assert kv.reserve_embedding(6) is None  # 3 pages: more than the 2 not promised
    emb = kv.reserve_embedding(4)  # 2 pages: exactly what is not promised
    assert emb is not None and len(emb.pages) == 2
    usage = kv.check()
    assert usage.num_free == usage.num_promised == 5
    assert len(kv.grow(gen, 12)) == 5  # the promise holds while the embedding step runs
    kv.release(emb)
    kv.release(gen)
    assert kv.check().num_in_use == 0


def test_an_embedding_step_evicts_unlocked_cache_but_not_promised_pages():
    kv, _ = manager(8)
    done = run_to_end(kv, [3] * 8, 8)
    kv.release(done)  # 4 evictable pages, 4 free
    gen = kv.admit([], 6)  # 3 pages promised
    assert gen is not None
    emb = kv.reserve_embedding(8)  # 4 pages: 1 free beyond the promise + 3 evicted
    assert emb is not None
    usage = kv.check()  # the cached run is one node: all 4 of its pages went
    assert usage.num_evictable == 0 and usage.num_free == 4 and usage.num_promised == 3
    kv.release(emb)
    kv.release(gen)
    kv.check()


def test_a_pin_keeps_a_finished_request_s_prefix_until_unpinned():
    kv, _ = manager(8)
    handle = run_to_end(kv, [5] * 6, 6)
    node = kv.pin(handle)
    kv.release(handle)
    usage = kv.check()
    assert node is not None and usage.num_in_use == 3 and usage.num_evictable == 0
    kv.flush()
    assert kv.check().num_in_use == 3  # a flush keeps what is pinned
    kv.unpin(node)
    assert kv.check().num_evictable == 3
    kv.flush()
    assert kv.check().num_free == 8


def test_duplicate_pages_computed_twice_are_given_back():
    kv, _ = manager(12)
    a = kv.admit([], 6)
    b = kv.admit([], 6)  # the same prompt, admitted in the same round: nothing cached yet
    assert a is not None and b is not None
    for handle in (a, b):
        kv.grow(handle, 5)
        kv.cache_progress(handle, [4] * 5)
    assert a.pages[:2] == b.pages[:2]  # b reads a's cached copies now
    usage = kv.check()
    assert usage.num_in_use == 2 + 1 + 1  # the shared prefix and each one's own last page
    kv.release(a)
    kv.release(b)
    assert kv.check().num_evictable == 2


def test_without_a_prefix_cache_nothing_is_shared_or_kept():
    kv, alloc = manager(8, caching=False)
    assert not kv.is_caching
    handle = kv.admit([7] * 4, 6)
    assert handle is not None and handle.num_cached_tokens == 0
    kv.grow(handle, 6)
    kv.cache_progress(handle, [7] * 6)
    assert kv.pin(handle) is None
    kv.release(handle)
    usage = kv.check()
    assert usage.num_cached == 0 and usage.num_free == 8 and kv.match_len([7] * 4) == 0


def test_the_cache_and_the_pool_must_agree_on_the_page_size():
    alloc = PageAllocator(4, 4)
    with pytest.raises(ValueError, match="page_size"):
        KVManager(alloc, NoPrefixCache(2))
    assert KVManager(alloc, RadixCache(alloc)).page_size == 4
