"""Shared-memory all-reduce and all-gather between real rank processes: the same result as
gloo's on every rank, bit for bit across ranks; a rank that never arrives is an error within
the timeout, not a hang."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest

pytestmark = pytest.mark.timeout(300)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, size: int, addr: str, absent: int | None, q, no_room=False) -> None:
    import errno
    import os

    import torch
    import torch.distributed as dist

    from cadence.distributed.group import RankGroups
    from cadence.distributed.layout import RankLayout

    torch.set_num_threads(1)
    groups = RankGroups(RankLayout(tp_size=size), rank, addr, "gloo", 30.0)
    if no_room:  # /dev/shm full: the first rank cannot reserve the segment

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = full
        groups.use_shm(4096)
        x = torch.full((3,), float(rank + 1))
        q.put((rank, {"shm": groups.shm is not None, "sum": groups.all_reduce_(x).tolist()}))
        groups.close()
        return
    groups.use_shm(4096)
    assert groups.shm is not None
    groups.shm.timeout_s = 2.0
    out: dict = {}
    try:
        gen = torch.Generator().manual_seed(rank)
        for rows in (1, 3, 7):
            x = torch.randn(rows, 576 // 4, generator=gen)
            ref = x.clone()
            dist.all_reduce(ref, group=groups.tp_group)
            got = groups.all_reduce_(x.clone())
            out[f"reduce{rows}"] = (got.numpy(), ref.numpy())  # by value: the rank may be gone
        bf = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
        summed = groups.all_reduce_(bf.clone())
        out["bf16"] = (str(summed.dtype), summed.float().numpy())
        share = torch.full((2, 5), float(rank))
        out["gather"] = groups.all_gather_vocab(share, 5).numpy()
        big = torch.ones(5000)  # beyond the slots: through gloo
        out["big"] = groups.all_reduce_(big).numpy()
        if absent is not None:
            if rank != absent:
                try:
                    groups.all_reduce_(torch.ones(4))
                    out["absent"] = "returned"
                except RuntimeError as e:
                    out["absent"] = str(e)
            else:
                out["absent"] = "stayed away"
        q.put((rank, out))
    finally:
        if absent is None:
            groups.close()


def _run(size: int, absent: int | None = None, no_room: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    addr = f"127.0.0.1:{_port()}"
    procs = [
        ctx.Process(target=_rank, args=(r, size, addr, absent, q, no_room)) for r in range(size)
    ]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_collectives_match_gloo_on_every_rank(size):
    import numpy as np

    results = _run(size)
    for rows in (1, 3, 7):
        for rank in range(size):
            got, ref = results[rank][f"reduce{rows}"]
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
            # Every rank has the very same bits (summed in rank order everywhere).
            assert np.array_equal(got, results[0][f"reduce{rows}"][0])
    for rank in range(size):
        dtype, values = results[rank]["bf16"]
        assert dtype == "torch.bfloat16"
        assert np.array_equal(values, results[0]["bf16"][1])
        gathered = results[rank]["gather"]
        assert gathered.shape == (2, 5 * size)
        assert [int(v) for v in gathered[0, ::5]] == list(range(size))
        assert np.array_equal(results[rank]["big"], np.full(5000, float(size), np.float32))


def test_a_rank_that_never_arrives_is_an_error_within_the_timeout():
    results = _run(2, absent=1)
    assert "did not arrive within 2 s" in results[0]["absent"]


def test_no_room_in_dev_shm_keeps_gloo_on_every_rank():
    results = _run(2, no_room=True)
    assert [results[r]["shm"] for r in range(2)] == [False, False]
    assert results[0]["sum"] == results[1]["sum"] == [3.0, 3.0, 3.0]
