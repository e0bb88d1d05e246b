"""The prefix cache's namespaces (one tree per LoRA adapter load; None: the base model):
KV computed in one namespace is never matched in another, while locking, eviction and
flushing work across all of them and the KV books balance after every step. Admission keeps
a step within --max-loras-per-batch and admits each request into its adapter's namespace,
so this file also drives `Admission.take` with adapters."""

from __future__ import annotations

import pytest

from cadence.io_struct import SamplingParams
from cadence.mem_cache.allocator import PageAllocator
from cadence.mem_cache.kv_manager import KVHandle, KVManager
from cadence.mem_cache.prefix_cache import RadixCache
from cadence.scheduler.admission import Admission
from cadence.scheduler.req import Req
from cadence.server_args import ServerArgs

PAGE = 2
TOKENS = list(range(8))  # four whole pages


def cached(cache: RadixCache, alloc: PageAllocator, tokens, namespace):
    """Inserts `tokens` as a request that computed them would, then lets go of its own hold:
    the cache is left the pages' only holder. Returns the node that ends them."""
    pages = alloc.alloc(len(tokens) // PAGE)
    assert pages is not None
    node = cache.insert(tokens, pages, namespace)
    alloc.decref(pages)
    return node, pages


def books_balance(cache: RadixCache, alloc: PageAllocator, pool: int) -> None:
    """free + cached == pool (nothing else holds pages here), each cached page held once."""
    in_tree = [p for node in cache.nodes() for p in node.pages]
    assert len(in_tree) == len(set(in_tree)) == cache.num_cached_pages
    assert alloc.num_free_pages + cache.num_cached_pages == pool
    assert all(alloc.ref_counts[p] == 1 for p in in_tree)
    locked = sum(len(n.pages) for n in cache.nodes() if n.lock_ref > 0)
    assert cache.num_evictable_pages == cache.num_cached_pages - locked


# ---- the radix cache --------------------------------------------------------------------


@pytest.mark.parametrize(("stored", "asked"), [(1, None), (1, 2), (None, 1), (2, 1)])
def test_tokens_cached_in_one_namespace_are_not_matched_in_another(stored, asked):
    alloc = PageAllocator(16, PAGE)
    cache = RadixCache(alloc)
    node, pages = cached(cache, alloc, TOKENS, stored)
    assert cache.match_prefix(TOKENS, asked) == ([], None)
    assert cache.match_prefix(TOKENS, stored) == (pages, node)
    books_balance(cache, alloc, 16)


def test_the_same_tokens_live_once_per_namespace():
    alloc = PageAllocator(16, PAGE)
    cache = RadixCache(alloc)
    trees = {ns: cached(cache, alloc, TOKENS, ns) for ns in (None, 1, 2)}
    assert cache.num_cached_pages == 12
    for ns, (node, pages) in trees.items():
        assert cache.match_prefix(TOKENS + [99], ns) == (pages, node)
        assert cache.match_prefix(TOKENS[:4], ns)[0] == pages[:2]  # a split, in its own tree
    assert len({tuple(pages) for _, pages in trees.values()}) == 3
    # inserting the same tokens again in one namespace adds nothing
    again = alloc.alloc(4)
    assert again is not None
    assert cache.insert(TOKENS, again, 1) is cache.match_prefix(TOKENS, 1)[1]
    alloc.decref(again)
    books_balance(cache, alloc, 16)


def test_locks_hold_in_their_namespace_and_eviction_crosses_namespaces_by_age():
    alloc = PageAllocator(16, PAGE)
    cache = RadixCache(alloc)
    old, _ = cached(cache, alloc, TOKENS, 1)
    locked, locked_pages = cached(cache, alloc, TOKENS, 2)
    new, _ = cached(cache, alloc, TOKENS, None)
    cache.lock(locked)
    assert cache.num_evictable_pages == 8
    assert cache.evict(1) == 4  # the least recently used: namespace 1's, a whole node
    assert cache.match_prefix(TOKENS, 1) == ([], None)
    assert cache.match_prefix(TOKENS, None)[1] is new
    books_balance(cache, alloc, 16)
    assert cache.evict(100) == 4  # everything unlocked: the base model's
    assert cache.match_prefix(TOKENS, 2) == (locked_pages, locked)  # locked: kept
    assert cache.num_evictable_pages == 0
    cache.unlock(locked)
    assert cache.num_evictable_pages == 4
    assert cache.evict(1) == 4 and cache.num_cached_pages == 0
    assert alloc.num_free_pages == 16 and old.parent is None


def test_a_lock_in_one_namespace_keeps_only_its_own_path():
    alloc = PageAllocator(16, PAGE)
    cache = RadixCache(alloc)
    cached(cache, alloc, TOKENS, None)
    node, _ = cached(cache, alloc, TOKENS[:4] + [50, 51], 1)
    cache.lock(node)
    assert cache.num_evictable_pages == 4  # the base model's whole tree
    cache.reset()
    assert cache.match_prefix(TOKENS, None) == ([], None)
    assert len(cache.match_prefix(TOKENS[:4] + [50, 51], 1)[0]) == 3
    cache.unlock(node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)
    books_balance(cache, alloc, 16)


def test_reset_drops_every_namespaces_unlocked_pages():
    alloc = PageAllocator(32, PAGE)
    cache = RadixCache(alloc)
    for ns in (None, 1, 2, 3):
        cached(cache, alloc, TOKENS, ns)
    keep, keep_pages = cached(cache, alloc, [7, 7, 7, 7], 4)
    cache.lock(keep)
    cache.reset()
    assert cache.num_cached_pages == 2 and alloc.num_free_pages == 30
    assert [n for n in cache.nodes()] == [keep]
    assert all(cache.match_prefix(TOKENS, ns) == ([], None) for ns in (None, 1, 2, 3))
    assert cache.match_prefix([7, 7, 7, 7], 4) == (keep_pages, keep)
    books_balance(cache, alloc, 32)


# ---- the KV manager -----------------------------------------------------------------------


def compute(kv: KVManager, handle: KVHandle, tokens: list[int]) -> None:
    """What the scheduler does for a request that computed `tokens`: grow, cache, check."""
    kv.grow(handle, len(tokens))
    kv.check()
    kv.cache_progress(handle, tokens)
    kv.check()


def admit(kv: KVManager, tokens: list[int], total: int, namespace) -> KVHandle:
    handle = kv.admit(tokens[: len(tokens) - 1 - (len(tokens) - 1) % PAGE], total, namespace)
    assert handle is not None and handle.namespace == namespace
    kv.check()
    return handle


def test_kv_manager_keeps_each_adapters_kv_apart():
    alloc = PageAllocator(32, PAGE)
    kv = KVManager.build(alloc)
    first = admit(kv, TOKENS, 12, 1)
    assert first.num_cached_tokens == 0
    compute(kv, first, TOKENS)
    kv.release(first)
    assert kv.check().num_evictable == 4
    assert kv.match_len(TOKENS, 1) == 4
    assert kv.match_len(TOKENS, None) == kv.match_len(TOKENS, 2) == 0
    # the base model and another adapter compute their own; adapter 1 takes its pages
    base, other, same = (admit(kv, TOKENS, 12, ns) for ns in (None, 2, 1))
    assert (base.num_cached_tokens, other.num_cached_tokens, same.num_cached_tokens) == (0, 0, 6)
    for handle in (base, other, same):
        compute(kv, handle, TOKENS)
    assert len({tuple(h.pages[:4]) for h in (base, other, same)}) == 3
    usage = kv.check()
    assert usage.num_cached == 12 and usage.num_evictable == 0
    for handle in (base, other, same):
        kv.release(handle)
        kv.check()
    assert kv.check().num_evictable == 12
    kv.flush()
    usage = kv.check()
    assert usage.num_free == 32 and usage.num_cached == 0
    assert all(kv.match_len(TOKENS, ns) == 0 for ns in (None, 1, 2))


def test_same_tokens_computed_at_once_under_two_adapters_share_nothing():
    alloc = PageAllocator(32, PAGE)
    kv = KVManager.build(alloc)
    one, two, also_one = (admit(kv, TOKENS, 10, ns) for ns in (1, 2, 1))
    for handle in (one, two, also_one):
        compute(kv, handle, TOKENS)
    # also_one found one's pages in the tree and gave its duplicates back; two did not
    assert also_one.pages[:4] == one.pages[:4]
    assert not set(two.pages) & set(one.pages)
    assert kv.check().num_cached == 8
    for handle in (one, two, also_one):
        kv.release(handle)
    kv.flush()
    assert kv.check().num_free == 32


def test_flush_keeps_what_live_requests_lock_in_any_namespace():
    alloc = PageAllocator(32, PAGE)
    kv = KVManager.build(alloc)
    live = admit(kv, TOKENS, 10, 3)
    compute(kv, live, TOKENS)
    done = admit(kv, TOKENS, 10, None)
    compute(kv, done, TOKENS)
    kv.release(done)
    kv.flush()
    assert kv.match_len(TOKENS, 3) == 4 and kv.match_len(TOKENS, None) == 0
    kv.check()
    kv.release(live)
    kv.flush()
    assert kv.check().num_free == 32


# ---- admission within --max-loras-per-batch ---------------------------------------------


def admission(max_loras: int = 2, chunk: int = 2048, enable_lora: bool = True, pages: int = 64):
    lora = {"max_lora_rank": 8, "lora_target_modules": ["all"]} if enable_lora else {}
    args = ServerArgs(enable_lora=enable_lora, max_loras_per_batch=max_loras,
                      chunked_prefill_size=chunk, **lora)  # fmt: skip
    kv = KVManager.build(PageAllocator(pages, PAGE))
    return Admission(kv, args, context_len=256, relieve=lambda: False), kv


def req(rid: str, uid: int | None, tokens: list[int] | None = None) -> Req:
    ids = tokens if tokens is not None else [hash(rid) % 50 + i for i in range(5)]
    return Req(rid=rid, input_ids=ids, params=SamplingParams(max_new_tokens=4), lora_uid=uid)


def take_ids(adm: Admission, *args) -> list[str]:
    return [r.rid for r, _ in adm.take(*args)]


def test_a_request_whose_adapter_is_one_too_many_waits_and_others_pass_it():
    adm, kv = admission(max_loras=2)
    waiting = [req("a1", 1), req("b", 2), req("a2", 1), req("base", None), req("c", 3)]
    for r in waiting:
        adm.enqueue(r)
    # the base model runs already: one adapter more fits
    assert take_ids(adm, None, 1, {None}) == ["a1", "a2", "base"]
    assert [r.rid for r in adm.waiting] == ["b", "c"]
    chosen = {r.rid: r for r in waiting}
    assert all(chosen[rid].kv.namespace == chosen[rid].lora_uid for rid in ("a1", "a2", "base"))
    # nothing runs: b and c are two adapters, within the limit
    assert take_ids(adm, None, 0, set()) == ["b", "c"]
    kv.check()


def test_the_running_adapters_count_against_the_limit():
    adm, _ = admission(max_loras=2)
    for r in (req("x", 3), req("y", 1), req("z", None)):
        adm.enqueue(r)
    assert take_ids(adm, None, 2, {1, 2}) == ["y"]
    assert take_ids(adm, None, 1, {None, 3}) == ["x", "z"]


def test_the_chunked_requests_adapter_is_present():
    adm, _ = admission(max_loras=1, chunk=8)
    long = req("long", 1, list(range(12)))
    adm.enqueue(long)
    assert adm.take(None, 0, set()) == [(long, 8)]
    long.num_computed += 8  # the step ran (the scheduler's part)
    for r in (req("other", 2, [40, 41, 42]), req("same", 1, [50, 51, 52])):
        adm.enqueue(r)
    assert [(r.rid, n) for r, n in adm.take(long, 1, set())] == [("long", 4), ("same", 3)]
    assert [r.rid for r in adm.waiting] == ["other"]


def test_without_lora_the_limit_does_not_apply():
    adm, _ = admission(max_loras=1, enable_lora=False)
    for i, uid in enumerate((1, 2, 3, None)):
        adm.enqueue(req(f"r{i}", uid))
    assert take_ids(adm, None, 0, set()) == ["r0", "r1", "r2", "r3"]


def test_same_prompt_under_two_adapters_does_not_wait_for_the_others_pages():
    adm, _ = admission(max_loras=4)
    for rid, uid in (("one", 1), ("two", 2), ("one-again", 1)):
        adm.enqueue(req(rid, uid, list(TOKENS)))
    # one-again would take one's pages from the cache next round; two cannot use them
    assert take_ids(adm, None, 0, set()) == ["one", "two"]
    assert [r.rid for r in adm.waiting] == ["one-again"]


def test_a_cached_prefix_is_found_only_under_its_adapter():
    adm, kv = admission(max_loras=4)
    first = admit(kv, TOKENS, 10, 1)
    compute(kv, first, TOKENS)
    kv.release(first)
    reqs = [req(f"r{uid}", uid, TOKENS + [60]) for uid in (None, 1, 2)]
    for r in reqs:
        adm.enqueue(r)
    adm.take(None, 0, set())
    assert {r.rid: r.num_computed for r in reqs} == {"rNone": 0, "r1": 8, "r2": 0}
    kv.check()
