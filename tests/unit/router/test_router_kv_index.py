"""The router's view of each worker's prefix cache, from its KV events, and cache_aware
routing by it: the longest run of the prompt's pages wins, a sequence gap forgets, an
adapter's pages are not the base model's, and without events the policy keeps its tree."""

from __future__ import annotations

from cadence.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    chain_digests,
    encode_batch,
    event_hash,
)
from cadence.router.config import RouterConfig
from cadence.router.kv_index import KvEventIndex
from cadence.router.policies import CacheAwarePolicy
from cadence.router.request_meta import RouteMeta
from cadence.router.workers import Worker

PAGE = 4
PROMPT = list(range(100, 124))  # six pages


def hashes(tokens) -> list[int]:
    return [event_hash(d) for d in chain_digests(None, tokens, PAGE)]


def stored(tokens, lora_id=None) -> bytes:
    event = BlockStored(
        block_hashes=hashes(tokens), parent_block_hash=None, token_ids=list(tokens),
        block_size=PAGE, lora_id=lora_id, medium="GPU",
    )  # fmt: skip
    return encode_batch(KVEventBatch(ts=0.0, events=[event]))


def batch(*events) -> bytes:
    return encode_batch(KVEventBatch(ts=0.0, events=list(events)))


def index() -> KvEventIndex:
    return KvEventIndex(session=None)  # type: ignore[arg-type]  # no network in these tests


def test_overlap_counts_the_leading_pages_each_worker_holds():
    idx = index()
    idx.apply("a", 0, stored(PROMPT[:8]))
    idx.apply("b", 0, stored(PROMPT[:20]))
    assert idx.overlaps(["a", "b", "c"], PROMPT) == {"a": 2, "b": 5}
    idx.apply("b", 1, batch(BlockRemoved(block_hashes=hashes(PROMPT[:20])[2:])))
    assert idx.overlaps(["a", "b"], PROMPT) == {"a": 2, "b": 2}
    idx.apply("a", 1, batch(AllBlocksCleared()))
    assert idx.overlaps(["a", "b"], PROMPT) == {"a": 0, "b": 2}


def test_a_gap_in_sequence_numbers_forgets_the_worker_and_adapters_do_not_count():
    idx = index()
    idx.apply("a", 0, stored(PROMPT))
    idx.apply("a", 2, batch())  # batch 1 was missed: its removals may be lost
    assert idx.overlaps(["a"], PROMPT) == {"a": 0}
    idx.apply("a", 3, stored(PROMPT, lora_id=7))
    assert idx.overlaps(["a"], PROMPT) == {"a": 0}


def workers(*loads: int) -> list[Worker]:
    return [
        Worker(url=f"http://w{i}", id=f"w{i}", model=None, capabilities=None, active=load)
        for i, load in enumerate(loads)
    ]


def test_cache_aware_routes_to_the_worker_holding_the_prompt_not_to_its_tree():
    policy = CacheAwarePolicy(RouterConfig())
    policy.kv_index = index()
    ws = workers(0, 0)
    text = "a long shared system prompt " * 20
    # The tree alone would send this text where it went before: w0.
    assert policy.select(ws, RouteMeta(prefix_text=text)).id in {"w0", "w1"}
    first = policy.select(ws, RouteMeta(prefix_text=text)).id
    other = "w1" if first == "w0" else "w0"
    policy.kv_index.apply(other, 0, stored(PROMPT))
    policy.kv_index.apply(first, 0, stored(PROMPT[:4]))
    meta = RouteMeta(prefix_text=text, token_ids=tuple(PROMPT))
    assert {policy.select(ws, meta).id for _ in range(4)} == {other}
    # No worker holds any of it: the least loaded one, not the tree's.
    busy = workers(1, 0)
    policy.kv_index.apply("w0", 1, batch(AllBlocksCleared()))
    policy.kv_index.apply("w1", 1, batch(AllBlocksCleared()))
    assert policy.select(busy, meta).id == "w1"


def test_without_events_or_tokens_the_tree_decides():
    policy = CacheAwarePolicy(RouterConfig())
    policy.kv_index = index()
    ws = workers(0, 0)
    text = "another long shared prompt " * 20
    first = policy.select(ws, RouteMeta(prefix_text=text, token_ids=tuple(PROMPT))).id
    assert {policy.select(ws, RouteMeta(prefix_text=text)).id for _ in range(3)} == {first}
