"""The disk tier without a model: pages written from a pool come back bit for bit into
other pages, the read runs on the tier's thread while admission goes on (`fetch_from_disk`
says False until it is done), and the KV books balance throughout."""

from __future__ import annotations

import time

import torch

from cadence.mem_cache.allocator import PageAllocator
from cadence.mem_cache.disk_tier import DiskTier, identity_of
from cadence.mem_cache.kv_manager import KVManager
from cadence.mem_cache.kv_pool import KVPool

PAGE = 4


def make(tmp_path, identity=b"a"):
    pool = KVPool(16, PAGE, 2, 2, 8, torch.float32)
    pool.commit()
    for buf in pool.kv_buffer:
        buf.normal_()
    disk = DiskTier(str(tmp_path), identity_of(identity), pool)
    kv = KVManager.build(PageAllocator(16, PAGE), disk=disk, write_through=True)
    return pool, disk, kv


def compute(kv: KVManager, tokens: list[int]):
    handle = kv.admit(tokens, len(tokens))
    kv.grow(handle, len(tokens))
    kv.cache_progress(handle, tokens)
    pages = list(handle.pages)
    kv.release(handle)
    return pages


def test_pages_come_back_bit_for_bit_after_a_flush(tmp_path):
    pool, disk, kv = make(tmp_path)
    tokens = list(range(12))  # three pages
    old_pages = compute(kv, tokens)
    before = pool.read_pages(old_pages)
    disk.flush()
    kv.flush()
    assert kv.usage().num_cached == 0
    for buf in pool.kv_buffer:  # what memory held is gone
        buf.zero_()
    assert not kv.fetch_from_disk(tokens + [99])  # the read starts; the request waits
    deadline = time.monotonic() + 5
    while not kv.fetch_from_disk(tokens + [99]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle = kv.admit(tokens + [99], 13)
    assert handle.num_cached_tokens == 12
    assert torch.equal(pool.read_pages(handle.pages[:3]), before)
    kv.release(handle)
    kv.check()
    disk.close()


def test_a_full_pool_makes_room_for_pages_read_back(tmp_path):
    """Memory full of other cached prefixes: the least recently used of them give way to the
    pages read back (a fetch into free pages only got none of them, and the request
    prefilled its whole history again)."""
    pool, disk, kv = make(tmp_path)
    history = list(range(100, 112))  # three pages, written through to disk
    compute(kv, history)
    disk.flush()  # their writes are done (the writer is a thread: a busy machine delays it)
    kv.flush()  # memory forgets it; the disk keeps it
    for k in range(5):  # fifteen of the sixteen pages: other conversations' prefixes
        compute(kv, list(range(200 + 12 * k, 212 + 12 * k)))
    assert kv.usage().num_free == 1
    deadline = time.monotonic() + 5
    while not kv.fetch_from_disk(history + [1]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle = kv.admit(history + [1], 13)
    assert handle.num_cached_tokens == 12  # all three pages came back
    kv.release(handle)
    kv.check()
    disk.close()


def test_another_identity_finds_nothing(tmp_path):
    _, disk, kv = make(tmp_path, b"a")
    tokens = list(range(8))
    compute(kv, tokens)
    disk.flush()
    disk.close()
    _, other, kv2 = make(tmp_path, b"b")
    assert kv2.fetch_from_disk(tokens + [1])  # nothing to read: admit at once
    assert kv2.admit(tokens + [1], 9).num_cached_tokens == 0
    other.close()


def test_an_adapters_pages_never_go_to_disk(tmp_path):
    _, disk, kv = make(tmp_path)
    handle = kv.admit(list(range(8)), 8, namespace=3)
    kv.grow(handle, 8)
    kv.cache_progress(handle, list(range(8)))
    kv.release(handle)
    disk.flush()
    assert disk.stats()["written"] == 0
    assert kv.fetch_from_disk(list(range(8)), namespace=3)
    disk.close()
