"""PageAllocator (the KVAllocator the scheduler borrows) and KVPool invariants: no model, no
torch compute beyond tiny tensors (and one 96 MiB pool, committed for real)."""

import ctypes
import os
import sys

import pytest
import torch

from cadence.mem_cache.allocator import KVAllocator, PageAllocator
from cadence.mem_cache.kv_pool import KVPool


def held(alloc: PageAllocator) -> set[int]:
    return {p for p, c in enumerate(alloc.ref_counts) if c > 0}


def check_invariants(alloc: PageAllocator) -> None:
    free = alloc.free_pages
    assert len(free) == len(set(free)), "a page is on the free list twice"
    assert all(alloc.ref_counts[p] == 0 for p in free), "a free page has holders"
    assert held(alloc).isdisjoint(free)
    assert alloc.num_free_pages + len(held(alloc)) == alloc.num_pages


def test_fresh_allocator_is_all_free():
    alloc = PageAllocator(8)
    assert alloc.num_free_pages == alloc.num_pages == 8
    check_invariants(alloc)


def test_alloc_gives_distinct_pages_with_refcount_one():
    alloc = PageAllocator(8)
    a = alloc.alloc(3)
    b = alloc.alloc(2)
    assert len(a) == 3 and len(b) == 2
    assert set(a).isdisjoint(b)
    assert all(alloc.ref_counts[p] == 1 for p in a + b)
    assert alloc.num_free_pages == 3
    check_invariants(alloc)


def test_fresh_pages_are_low_and_contiguous():
    alloc = PageAllocator(8)
    assert alloc.alloc(4) == [0, 1, 2, 3]


def test_alloc_zero_is_empty_and_takes_nothing():
    alloc = PageAllocator(4)
    assert alloc.alloc(0) == []
    assert alloc.num_free_pages == 4


def test_exhaustion_returns_none_and_takes_nothing():
    alloc = PageAllocator(4)
    first = alloc.alloc(3)
    assert alloc.alloc(2) is None  # only one left: all or nothing
    assert alloc.num_free_pages == 1
    last = alloc.alloc(1)
    assert alloc.num_free_pages == 0
    assert alloc.alloc(1) is None
    assert sorted(first + last) == [0, 1, 2, 3]
    check_invariants(alloc)


def test_decref_returns_pages_to_free_list():
    alloc = PageAllocator(4)
    pages = alloc.alloc(4)
    alloc.decref(pages[:2])
    assert alloc.num_free_pages == 2
    check_invariants(alloc)
    alloc.decref(pages[2:])
    assert alloc.num_free_pages == 4
    check_invariants(alloc)
    assert sorted(alloc.alloc(4)) == [0, 1, 2, 3]  # every page usable again


def test_shared_page_is_freed_only_by_its_last_holder():
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.incref(pages)  # a second request shares them (prefix cache)
    assert [alloc.ref_counts[p] for p in pages] == [2, 2]
    alloc.decref(pages)
    assert alloc.num_free_pages == 2, "pages still held by the second holder were freed"
    assert all(alloc.ref_counts[p] == 1 for p in pages)
    check_invariants(alloc)
    alloc.decref(pages)
    assert alloc.num_free_pages == 4
    check_invariants(alloc)


def test_double_free_raises_and_keeps_free_list_sane():
    alloc = PageAllocator(4)
    pages = alloc.alloc(1)
    alloc.decref(pages)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.decref(pages)
    assert alloc.num_free_pages == 4
    check_invariants(alloc)


def test_decref_of_never_allocated_page_raises():
    alloc = PageAllocator(4)
    with pytest.raises(RuntimeError):
        alloc.decref([2])
    check_invariants(alloc)


def test_incref_of_free_page_raises():
    alloc = PageAllocator(4)
    with pytest.raises(RuntimeError, match="incref of free"):
        alloc.incref([0])
    assert alloc.ref_counts[0] == 0
    check_invariants(alloc)


def test_random_workload_keeps_invariants():
    import random

    rng = random.Random(0)
    alloc = PageAllocator(32)
    holders: list[list[int]] = []
    for _ in range(500):
        op = rng.random()
        if op < 0.45:
            pages = alloc.alloc(rng.randint(0, 6))
            if pages is not None:
                holders.append(pages)
        elif op < 0.6 and holders:
            shared = list(rng.choice(holders))
            alloc.incref(shared)
            holders.append(shared)
        elif holders:
            alloc.decref(holders.pop(rng.randrange(len(holders))))
        check_invariants(alloc)
        counts = [0] * alloc.num_pages
        for pages in holders:
            for p in pages:
                counts[p] += 1
        assert counts == alloc.ref_counts
    for pages in holders:
        alloc.decref(pages)
    assert alloc.num_free_pages == alloc.num_pages


def test_page_allocator_is_a_kv_allocator_that_counts_pages_for_tokens():
    alloc = PageAllocator(8, page_size=16)
    assert isinstance(alloc, KVAllocator)
    assert [alloc.pages_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_kv_pool_budget_matches_its_buffers():
    pool = KVPool(
        num_pages=4, page_size=16, num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float32
    )
    assert pool.num_slots == 64
    per_token = KVPool.bytes_per_token(2, 3, 8, torch.float32)
    assert per_token == 2 * 2 * 3 * 8 * 4  # K and V, every layer, float32
    assert KVPool.bytes_per_token(2, 3, 8, torch.bfloat16) == per_token // 2
    # Whatever the buffer layout, the pool holds exactly per_token bytes for every slot.
    tensors = [
        t
        for t in vars(pool).values()
        if isinstance(t, list)
        for t in t
        if isinstance(t, torch.Tensor)
    ]
    assert sum(t.numel() * t.element_size() for t in tensors) == per_token * pool.num_slots
    with pytest.raises(ValueError, match="max_total_tokens"):
        KVPool(0, 16, 1, 1, 8, torch.float32)


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The fraction of `tensor`'s memory pages that are resident now (mincore(2)), whatever
    else this process holds: a test process's heap may hand out memory it already touched."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    num_pages = -(-(end - start) // page)
    vec = (ctypes.c_ubyte * num_pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / num_pages


@pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) as Linux has it")
def test_commit_takes_the_pools_memory_at_once_and_in_place():
    # 48 MiB a layer: above any default malloc mmap threshold, so the buffers are fresh maps.
    pool = KVPool(
        num_pages=3072, page_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )
    assert pool.num_bytes == 2 * (2 * 2 * 3072 * 16 * 64 * 4) and not pool.is_committed
    where = [buf.data_ptr() for buf in pool.kv_buffer]
    pool.commit()
    assert pool.is_committed
    resident = [_resident_fraction(buf) for buf in pool.kv_buffer]
    assert min(resident) == 1.0, f"resident after commit: {resident}"
    assert [buf.data_ptr() for buf in pool.kv_buffer] == where  # written in place, not copied
    assert all(not buf.any() for buf in pool.kv_buffer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_pack_and_unpack_the_same_with_the_cpu_kernel_and_with_torch(dtype, monkeypatch):
    """gather_pages / scatter_pages (prefill/decode disaggregation): Cadence's memcpy kernel
    and torch's index ops give the same packed bytes, and unpacking puts pages back."""
    from cadence.mem_cache import kv_pool

    src = KVPool(12, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    for buf in src.kv_buffer:
        buf.normal_()
    pages = [7, 2, 11, 5]
    packed = {}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setattr(kv_pool.KVPool, "_move_pages", lambda *a: False)
        out = torch.empty(len(pages) * src.page_nbytes, dtype=torch.uint8)
        src.gather_pages(pages, out)
        packed[path] = out
        dst = KVPool(9, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, scratch_page=True)
        for buf in dst.kv_buffer:
            buf.zero_()
        dst.scatter_pages([0, 8, 3, 1], out)
        for a, b in zip(src.kv_buffer, dst.kv_buffer):
            assert torch.equal(a[:, :, pages], b[:, :, [0, 8, 3, 1]])
        assert dst.kv_buffer[0][:, :, 2].abs().sum() == 0  # no other page touched
    assert torch.equal(packed["kernel"], packed["torch"])
    assert src.layout == f"{str(dtype)[6:]}:[3, 2, 2, 4, 8]"


def test_a_pool_moves_into_given_storage_and_copies_pages_from_another(monkeypatch):
    """The prefill server's pool moves into shared memory (contents kept); a decode server's
    pool copies pages out of it, with the CPU kernel and with torch's ops alike."""
    from cadence.mem_cache import kv_pool

    src = KVPool(12, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    for buf in src.kv_buffer:
        buf.normal_()
    before = [buf.clone() for buf in src.kv_buffer]
    storage = torch.zeros(src.num_bytes + 64, dtype=torch.uint8)
    src.move_into(storage)
    assert all(torch.equal(a, b) for a, b in zip(src.kv_buffer, before))
    assert src.kv_buffer[0].data_ptr() == storage.data_ptr()
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr("cadence.kernels.cpu_kernels_available", lambda: False)
        dst = KVPool(7, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        for buf in dst.kv_buffer:
            buf.zero_()
        dst.copy_pages_from(src.kv_buffer, [11, 0, 5], [6, 2, 3])
        for a, b in zip(src.kv_buffer, dst.kv_buffer):
            assert torch.equal(a[:, :, [11, 0, 5]], b[:, :, [6, 2, 3]])
        assert dst.kv_buffer[1][:, :, [0, 1, 4, 5]].abs().sum() == 0
    assert kv_pool.KVPool is KVPool
