"""What a pipeline must hold once nothing is in flight: no request state on any stage, every
relay credit back, no shared memory beyond each live process's own pool."""

from __future__ import annotations

import asyncio

from cadence.pipeline.relay.shm import list_segments


def segments_of(pipeline) -> list[str]:
    """The shared-memory segments this pipeline's processes own now."""
    return [n for n in list_segments() if f"-{pipeline.pipeline_id}-" in n]


async def wait_clean(pipeline, timeout: float = 10.0) -> dict:
    """Polls every stage process until none holds request state and every relay has all its
    credits back; returns the last stats (the caller asserts on them)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await pipeline.coordinator.stage_stats()
        if all(_clean(s) for s in stats.values()) and not pipeline.coordinator.tracker.pending:
            return stats
        if asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.05)


def _clean(stats) -> bool:
    relay = stats.relay
    if any(stats.live.values()) or relay.get("pending", 0) or relay.get("rids", 0):
        return False
    if relay.get("borrowed", 0) or relay.get("lent", 0):  # zero-copy: lent slots all back
        return False
    return relay.get("free", 0) == relay.get("credits", 0) and not relay.get("copying", 0)


def describe(stats: dict) -> dict:
    return {p: {"live": s.live, "relay": s.relay} for p, s in stats.items()}


async def assert_clean(pipeline) -> None:
    stats = await wait_clean(pipeline)
    assert all(_clean(s) for s in stats.values()), describe(stats)
    assert not pipeline.coordinator.tracker.pending
    # Every stage process answered, and the front too when stages are placed there.
    assert len(stats) == len(pipeline.graph.processes) + bool(pipeline.graph.front_stages)
