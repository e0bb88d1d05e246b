"""KV-cache events: the prefix cache records what it stores and drops, hashed the way
SGLang hashes pages, and the publisher sends them in SGLang's wire shapes (a PUB socket,
three frames per batch, a replay ROUTER)."""

from __future__ import annotations

import hashlib
import json
import time

import msgspec
import pytest
import zmq

from cadence.mem_cache.allocator import PageAllocator
from cadence.mem_cache.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventRecorder,
    KVEventsConfig,
    chain_digests,
    decode_batch,
    encode_batch,
    event_hash,
)
from cadence.mem_cache.prefix_cache import RadixCache

PAGE = 2


def sha_chain(tokens: list[int]) -> list[int]:
    """The reference: SHA-256 over the previous digest and the page as LE uint32, top 8 bytes."""
    out, prev = [], b""
    for i in range(0, len(tokens) - PAGE + 1, PAGE):
        data = prev + b"".join(t.to_bytes(4, "little") for t in tokens[i : i + PAGE])
        prev = hashlib.sha256(data).digest()
        out.append(int.from_bytes(prev[:8], "big", signed=True))
    return out


def make_cache(pages: int = 32) -> tuple[RadixCache, PageAllocator, KVEventRecorder]:
    alloc = PageAllocator(pages, PAGE)
    recorder = KVEventRecorder(PAGE)
    return RadixCache(alloc, recorder), alloc, recorder


def insert(cache, alloc, tokens, namespace=None):
    pages = alloc.alloc(len(tokens) // PAGE)
    node = cache.insert(tokens, pages, namespace)
    alloc.decref(pages)  # the cache is their only holder
    return node


def test_page_hashes_are_sglangs_chained_sha256():
    tokens = [5, 70000, 3, 9, 11, 2**31]
    digests = chain_digests(None, tokens, PAGE)
    assert [event_hash(d) for d in digests] == sha_chain(tokens)
    assert chain_digests(None, tokens[:5], PAGE)[:2] == digests[:2]  # a partial page: none


def test_an_insert_records_its_new_pages_chained_to_what_was_cached():
    cache, alloc, rec = make_cache()
    insert(cache, alloc, [1, 2, 3, 4])
    insert(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])  # extends it
    insert(cache, alloc, [1, 2, 9, 9])  # splits the first node after one page
    first, second, third = rec.take()
    full = sha_chain([1, 2, 3, 4, 5, 6, 7, 8])
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    assert first.block_hashes == full[:2] and first.token_ids == [1, 2, 3, 4]
    assert second.block_hashes == full[2:] and second.parent_block_hash == full[1]
    assert second.token_ids == [5, 6, 7, 8] and second.block_size == PAGE
    assert third.block_hashes == sha_chain([1, 2, 9, 9])[1:]
    assert third.parent_block_hash == full[0]  # the split's head ends at page one
    assert rec.take() == []


def test_eviction_and_flush_record_removals_then_all_cleared():
    cache, alloc, rec = make_cache()
    insert(cache, alloc, [1, 2, 3, 4])
    insert(cache, alloc, [1, 2, 9, 9])
    rec.take()
    full, other = sha_chain([1, 2, 3, 4]), sha_chain([1, 2, 9, 9])
    cache.evict(1)  # one least recently used leaf
    (removed,) = rec.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [full[1]]
    cache.reset()
    events = rec.take()
    removed = sorted(h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes)
    assert removed == sorted([other[1], full[0]])
    assert isinstance(events[-1], AllBlocksCleared)
    assert cache.num_cached_pages == 0


def test_a_flush_that_keeps_locked_pages_clears_nothing_else():
    cache, alloc, rec = make_cache()
    node = insert(cache, alloc, [1, 2, 3, 4])
    insert(cache, alloc, [7, 7])
    cache.lock(node)
    rec.take()
    cache.reset()
    events = rec.take()
    assert [type(e) for e in events] == [BlockRemoved]  # [7, 7] only; no AllBlocksCleared
    assert events[0].block_hashes == sha_chain([7, 7]) and events[0].medium == "GPU"


def test_an_adapters_pages_hash_apart_and_carry_its_id():
    cache, alloc, rec = make_cache()
    insert(cache, alloc, [1, 2, 3, 4])
    insert(cache, alloc, [1, 2, 3, 4], namespace=7)
    base, lora = rec.take()
    assert lora.lora_id == 7 and base.lora_id is None
    assert set(base.block_hashes).isdisjoint(lora.block_hashes)
    assert lora.parent_block_hash is None  # first pages under its root


def test_the_wire_format_is_sglangs():
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[1, 2],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                medium="GPU",
            ),
            BlockRemoved(block_hashes=[3], medium="GPU"),
            AllBlocksCleared(),
        ],
        dp_rank=0,
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        1.5,
        [
            {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": 2, "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]  # fmt: skip
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.parametrize(
    "text,field",
    [
        ("{", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"publisher": "zmq", "buffer_steps": -1}', "buffer_steps"),
        ('{"publisher": "zmq", "endpoint": "5557"}', "endpoint"),
        ('{"publisher": "zmq", "colour": 1}', "colour"),
    ],
)
def test_a_bad_config_names_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        KVEventsConfig.parse(text)


def test_null_or_absent_config_publishes_nothing():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"publisher": "null"}') is None
    assert KVEventsConfig.parse('{"publisher": "zmq"}').endpoint == "tcp://*:5557"


def test_publisher_sends_three_frames_and_replays_from_a_sequence_number(tmp_path):
    config = KVEventsConfig.parse(
        json.dumps(
            {
                "publisher": "zmq",
                "endpoint": f"ipc://{tmp_path}/ev",
                "replay_endpoint": f"ipc://{tmp_path}/replay",
                "topic": "kv",
            }
        )
    )
    publisher = KVEventPublisher(config)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(config.local_endpoint)
    try:
        deadline = time.monotonic() + 5  # a SUB misses what was sent before it joined
        while not sub.poll(50) and time.monotonic() < deadline:
            publisher.publish([AllBlocksCleared()])
        while sub.poll(100):
            sub.recv_multipart()
        first = publisher.seq
        publisher.publish([BlockRemoved(block_hashes=[1])])
        publisher.publish([BlockRemoved(block_hashes=[2])])
        topic, seq, payload = sub.recv_multipart()
        while int.from_bytes(seq, "big") < first:  # a late one of the joining batches
            topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and int.from_bytes(seq, "big") == first
        assert decode_batch(payload).events == [BlockRemoved(block_hashes=[1])]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(config.local_replay_endpoint)
        dealer.send_multipart([b"", first.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[2] == END_OF_REPLAY:
                break
            got.append((int.from_bytes(frames[2], "big"), decode_batch(frames[3]).events))
        assert got == [
            (first, [BlockRemoved(block_hashes=[1])]),
            (first + 1, [BlockRemoved(block_hashes=[2])]),
        ]
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        publisher.close()
