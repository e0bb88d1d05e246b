"""Each relay backend between two real processes: every payload arrives equal to the byte
(dtypes, nesting, oversized and thread-copied payloads), a request dropped after its put
is drained, and both sides end with nothing held and nothing left in /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import socket
import uuid

import msgspec
import pytest
import torch
from relay_peer import (
    LEND_CREDITS,
    lend_payloads,
    make_payloads,
    run_lend_receiver,
    run_lend_sender,
    run_receiver,
    run_sender,
)

from cadence.pipeline.messages import PayloadHeader
from cadence.pipeline.payload import extract, restore
from cadence.pipeline.relay.shm import list_segments, sweep_dead_segments

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reap(procs) -> None:
    """Waits for both sides, kills one that hangs, and removes what a killed side left (the
    assertions after it then fail on the exit codes)."""
    for proc in procs:
        proc.join(timeout=30)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    sweep_dead_segments()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
            )
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_payloads_cross_two_processes(backend):
    pipeline_id = uuid.uuid4().hex[:8]
    store = f"127.0.0.1:{_free_port()}"
    spawn = mp.get_context("forkserver")
    link_a, link_b = spawn.Pipe()
    reports = [spawn.Pipe(duplex=False) for _ in range(2)]
    procs = []
    for rank, target in ((0, run_sender), (1, run_receiver)):
        ctx = msgspec.msgpack.encode(
            {"backend": backend, "pipeline_id": pipeline_id, "rank": rank, "store": store}
        )
        link = link_a if rank == 0 else link_b
        procs.append(spawn.Process(target=target, args=(ctx, link, reports[rank][1])))
    for proc in procs:
        proc.start()
    try:
        receiver = reports[1][0]
        for i, want in enumerate(make_payloads()):
            assert receiver.poll(30), f"payload {i} did not arrive"
            header = msgspec.msgpack.decode(receiver.recv_bytes(), type=PayloadHeader)
            data = receiver.recv_bytes()
            got = restore(
                header, torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
            )
            assert _same(got, want), f"payload {i} differs"
            assert header.tensors == extract(want).header.tensors
        stats = [msgspec.msgpack.decode(reports[r][0].recv_bytes()) for r in (0, 1)]
    finally:
        _reap(procs)
    assert [p.exitcode for p in procs] == [0, 0]
    for s in stats:
        assert s["pending"] == 0 and s.get("rids", 0) == 0, stats
        if backend == "shm":
            assert s["free"] == s["credits"] == 2 and s["copying"] == 0, stats
    assert [n for n in list_segments() if pipeline_id in n] == []


def test_shm_lends_large_payloads_across_two_processes():
    """Zero-copy receive: the receiver reads a large payload where the sender put it; the put
    completes when it is taken, the slot comes back when the receiver drops the last view,
    when it drains a payload whose request the sender dropped, or when it dies holding it."""
    pipeline_id = uuid.uuid4().hex[:8]
    spawn = mp.get_context("forkserver")
    link_a, link_b = spawn.Pipe()
    reports = [spawn.Pipe(duplex=False) for _ in range(2)]
    procs = [
        spawn.Process(target=run_lend_sender, args=(pipeline_id, link_a, reports[0][1])),
        spawn.Process(target=run_lend_receiver, args=(pipeline_id, link_b, reports[1][1])),
    ]
    for proc in procs:
        proc.start()
    try:
        receiver, sender = reports[1][0], reports[0][0]
        assert receiver.poll(30), "the lent payload did not arrive"
        header = msgspec.msgpack.decode(receiver.recv_bytes(), type=PayloadHeader)
        data = receiver.recv_bytes()
        got = restore(header, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        assert _same(got, lend_payloads()[0])
        lent_while_held, lent_after, released = msgspec.msgpack.decode(receiver.recv_bytes())
        assert (lent_while_held, lent_after, released) == (1, 0, 1)
        assert sender.poll(30), "the sender did not finish"
        taken, freed, cleaned, drained, orphaned, reclaimed = msgspec.msgpack.decode(
            sender.recv_bytes()
        )
    finally:
        _reap(procs)
    assert [p.exitcode for p in procs] == [0, 0]
    full = LEND_CREDITS
    # Taken: the put is done (nothing pending), its slot still lent.
    assert (taken["pending"], taken["borrowed"], taken["free"]) == (0, 1, full - 1), taken
    assert (freed["pending"], freed["borrowed"], freed["free"]) == (0, 0, full), freed
    # Cleaned up before any acknowledgement: held until the receiver says it drained it.
    assert (cleaned["pending"], cleaned["borrowed"], cleaned["free"]) == (0, 1, full - 1)
    assert (drained["borrowed"], drained["free"]) == (0, full), drained
    # Its borrower died holding it: taken back.
    assert (orphaned["borrowed"], orphaned["free"]) == (1, full - 1), orphaned
    assert (reclaimed["borrowed"], reclaimed["free"], reclaimed["rids"]) == (0, full, 0)
    assert [n for n in list_segments() if pipeline_id in n] == []
