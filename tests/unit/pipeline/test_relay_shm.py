"""The shm relay in one process: slots and credits, oversized payloads in their own segment,
cleanup and close, and the sweep of dead owners' segments. Every test ends with the pool
whole: no credit lost, no segment left in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
import torch

from cadence.pipeline.config import RelayConfig
from cadence.pipeline.payload import extract, restore
from cadence.pipeline.relay import RelayAborted, RelayContext, RelayTimeout, create_relay
from cadence.pipeline.relay.shm import SHM_DIR, list_segments, owner_pid, sweep_dead_segments

SLOT = 64 * 1024


def _relay(credits: int = 2, timeout: float = 5.0):
    config = RelayConfig(slot_mb=SLOT / (1 << 20), credits=credits, transfer_timeout_s=timeout)
    ctx = RelayContext(
        pipeline_id=uuid.uuid4().hex[:8], rank=0, world_size=2, device="cpu", config=config
    )
    return create_relay(ctx)


def _mine(relay) -> list[str]:
    return [n for n in list_segments() if relay.ctx.pipeline_id in n]


def _whole(relay) -> bool:
    s = relay.stats()
    return s["free"] == s["credits"] and s["pending"] == s["copying"] == s["rids"] == 0


async def _transfer(relay, payload, rid="r1"):
    extracted = extract(payload)
    op = await relay.put_payload_async(extracted, rid, 1)
    dest = torch.empty(op.metadata["size"], dtype=torch.uint8)
    got = await relay.get_async(op.metadata, dest, rid)
    await got.wait_for_completion(1)
    return op, restore(extracted.header, dest)


async def test_put_get_ack_returns_the_credit():
    relay = _relay()
    try:
        payload = {
            "x": torch.arange(1000, dtype=torch.float32),
            "y": [torch.ones(3, dtype=torch.int8)],
        }
        op, got = await _transfer(relay, payload)
        assert torch.equal(got["x"], payload["x"]) and torch.equal(got["y"][0], payload["y"][0])
        assert relay.stats()["free"] == 1 and relay.stats()["pending"] == 1
        assert op.metadata["segment"] == f"cadence-relay-{os.getpid()}-{relay.ctx.pipeline_id}-pool"
        relay.acknowledge(op.metadata)
        await op.wait_for_completion(1)
        relay.acknowledge(op.metadata)  # twice: harmless
        assert _whole(relay)
    finally:
        relay.close()
    assert _mine(relay) == []


async def test_a_sender_waits_for_a_credit_and_times_out_without_losing_one():
    relay = _relay(credits=1, timeout=0.3)
    try:
        first = await relay.put_async(torch.ones(10, dtype=torch.uint8), "r1", 1)
        waiting = asyncio.ensure_future(relay.put_async(torch.ones(10, dtype=torch.uint8), "r2", 1))
        await asyncio.sleep(0.05)
        assert not waiting.done() and relay.stats()["waiters"] == 1
        relay.acknowledge(first.metadata)
        second = await waiting
        with pytest.raises(RelayTimeout, match="no shared-memory slot came free"):
            await relay.put_async(torch.ones(10, dtype=torch.uint8), "r3", 1)
        with pytest.raises(RelayTimeout, match="did not read shared memory"):
            await second.wait_for_completion(0.05)
        relay.acknowledge(second.metadata)
        assert _whole(relay) and relay.stats()["waiters"] == 0
    finally:
        relay.close()


async def test_an_oversized_payload_gets_a_segment_of_its_own():
    relay = _relay()
    try:
        big = torch.arange(SLOT, dtype=torch.int32)  # 4 slots' worth
        op, got = await _transfer(relay, {"big": big}, "big")
        assert torch.equal(got["big"], big)
        assert op.metadata["segment"].endswith(f"-d{op.metadata['seq']}")
        assert os.path.exists(os.path.join(SHM_DIR, op.metadata["segment"]))
        assert relay.stats()["dedicated"] == 1 and relay.stats()["free"] == 1  # it took a credit
        relay.acknowledge(op.metadata)
        assert not os.path.exists(os.path.join(SHM_DIR, op.metadata["segment"]))
        assert _whole(relay)
    finally:
        relay.close()


async def test_cleanup_releases_a_request_and_ends_its_waits():
    relay = _relay(credits=3)
    try:
        ops = [
            await relay.put_async(torch.ones(10, dtype=torch.uint8), "gone", 1),
            await relay.put_async(torch.ones(SLOT * 2, dtype=torch.uint8), "gone", 1),
            await relay.put_async(torch.ones(10, dtype=torch.uint8), "kept", 1),
        ]
        waiter = asyncio.ensure_future(ops[0].wait_for_completion(5))
        await asyncio.sleep(0)
        relay.cleanup("gone")
        with pytest.raises(RelayAborted):
            await waiter
        assert relay.stats()["free"] == 2 and relay.stats()["dedicated"] == 0
        relay.acknowledge(ops[0].metadata)  # a late ack of a cleaned-up put: ignored
        relay.acknowledge(ops[2].metadata)
        assert _whole(relay)
    finally:
        relay.close()


async def test_a_put_cancelled_mid_copy_gives_its_slot_back():
    relay = _relay(credits=1)
    try:
        task = asyncio.ensure_future(
            relay.put_async(torch.ones(8 << 20, dtype=torch.uint8), "r", 1)
        )
        await asyncio.sleep(0)  # the copy runs on a thread now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if _whole(relay):
                break
            await asyncio.sleep(0.02)
        assert _whole(relay) and _mine(relay) == [relay.pool.name]
    finally:
        relay.close()


async def test_close_unlinks_everything_it_owns():
    relay = _relay()
    await relay.put_async(torch.ones(SLOT * 2, dtype=torch.uint8), "r", 1)
    assert len(_mine(relay)) == 2
    relay.close()
    assert _mine(relay) == []


def test_the_sweep_removes_only_segments_of_dead_owners():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    tag = uuid.uuid4().hex[:8]
    names = [f"cadence-relay-{dead_pid}-{tag}-pool", f"cadence-relay-{os.getpid()}-{tag}-pool"]
    for name in names:
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        assert owner_pid(names[0]) == dead_pid
        removed = sweep_dead_segments()
        assert names[0] in removed and names[1] not in removed
        assert names[0] not in list_segments() and names[1] in list_segments()
    finally:
        for name in names:
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
