"""Nothing outlives a request: 500 requests through fan-out, a stream edge, fan-in and
colocated stages, a third of them aborted at random moments (so at every stage, mid-stream
too) and some failing; then a stage SIGKILLed mid-transfer and restarted; then shutdown.
Afterwards no stage holds request state, every relay credit is back, and no shared-memory
segment of the pipeline is left in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
from pipeline_checks import assert_clean, segments_of
from pipeline_graphs import E, request

from cadence.pipeline import Pipeline, PipelineConfig, RelayConfig, StageConfig
from cadence.pipeline.errors import PipelineUnavailable, RequestAborted, StageFailed
from cadence.pipeline.relay.shm import list_segments

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STAGES = "abcde"


def mixed(relay: RelayConfig) -> PipelineConfig:
    """a -> (b, c); b streams to d (and the client); c -> d; d -> e, colocated."""
    return PipelineConfig(
        name="mixed",
        relay=relay,
        stages=[
            StageConfig(name="a", executor=E + "Step", args={"add": 1.0}, next=["b", "c"]),
            StageConfig(
                name="b",
                executor=E + "Producer",
                args={"num_chunks": 3},
                stream_to="d",
                stream_to_client=True,
            ),
            StageConfig(name="c", executor=E + "Step", args={"scale": 2.0}, next="d"),
            StageConfig(name="d", executor=E + "Collect", next="e"),
            StageConfig(
                name="e",
                executor=E + "Step",
                args={"add": 3.0},
                colocate_with=["d"],
                terminal=True,
            ),
        ],
    )


async def _one(pipeline, i: int, rng: random.Random, seed: int) -> str:
    """One request, maybe aborted after a random pause, maybe failing or blocking at a
    random stage; returns how it ended."""
    options = {"sleep_ms": 4}
    roll = rng.random()
    if roll < 0.05:
        options["fail"] = rng.choice(STAGES)
    elif roll < 0.15:
        options["block"] = rng.choice(STAGES)
    numel = rng.choice([256, 4096, 20000, 1 << 17])  # 1 KiB .. 512 KiB (past a slot)
    rid = f"life-{seed}-{i}"
    coordinator = pipeline.coordinator
    if rng.random() < 0.5:
        call = asyncio.ensure_future(coordinator.submit(request(i, numel=numel, **options), rid))
    else:
        call = asyncio.ensure_future(
            _drain(coordinator.stream(request(i, numel=numel, **options), rid))
        )
    if "block" in options or rng.random() < 0.3:
        await asyncio.sleep(rng.uniform(0, 0.03))
        coordinator.abort(rid, "lifetime test")
    try:
        await call
        return "ok"
    except RequestAborted:
        return "aborted"
    except StageFailed:
        return "failed"


def _died(error) -> bool:
    """How a request in flight to a killed stage fails: the launcher's notice, or (torch) a
    stage whose transfer to the dead one broke first, naming it."""
    if isinstance(error, PipelineUnavailable):
        return "stage process d+e" in str(error) and "SIGKILL" in str(error)
    return isinstance(error, StageFailed) and "to stage 'd' failed" in str(error)


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def _many(pipeline, count: int, seed: int, concurrency: int = 24) -> dict:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    outcomes: dict[str, int] = {}

    async def one(i: int) -> None:
        async with limit:
            outcome = await _one(pipeline, i, rng, seed)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    await asyncio.gather(*(one(i) for i in range(count)))
    return outcomes


@pytest.mark.parametrize(
    "relay, count",
    [
        (RelayConfig(backend="shm", slot_mb=1 / 4, credits=8, inline_max_bytes=0), 500),
        (
            RelayConfig(
                backend="shm", slot_mb=1 / 4, credits=8, inline_max_bytes=0, zero_copy_min_bytes=0
            ),
            500,
        ),
        (RelayConfig(backend="torch", inline_max_bytes=0), 500),
    ],
    ids=["shm", "shm-zero-copy", "torch"],
)
async def test_nothing_outlives_its_request(relay, count):
    pipeline = await Pipeline.start(mixed(relay), restart_stages=True)
    pids = set()
    try:
        outcomes = await _many(pipeline, count, seed=1)
        assert sum(outcomes.values()) == count
        assert outcomes.get("ok", 0) > count // 3 and outcomes.get("aborted", 0) > count // 10
        assert outcomes.get("failed", 0) > 0
        await assert_clean(pipeline)

        # A stage process killed mid-transfer: d+e stalls, so a's and b's and c's transfers
        # to it stay unread (credits held), and then it is SIGKILLed.
        stalled = [
            asyncio.ensure_future(
                pipeline.coordinator.submit(request(1000 + i, numel=1 << 16, stall="d"))
            )
            for i in range(6)
        ]
        await asyncio.sleep(0.5)
        pids = {p.pid for p in pipeline.processes.values()}
        os.kill(pipeline.processes["d+e"].pid, signal.SIGKILL)
        results = await asyncio.gather(*stalled, return_exceptions=True)
        assert all(_died(r) for r in results), results
        for _ in range(200):
            if pipeline.coordinator.is_healthy:
                break
            await asyncio.sleep(0.05)
        assert pipeline.coordinator.is_healthy
        outcomes = await _many(pipeline, 50, seed=2)
        assert outcomes.get("ok", 0) > 0
        await assert_clean(pipeline)
        pids |= {p.pid for p in pipeline.processes.values()}
    finally:
        await pipeline.shutdown()
    assert segments_of(pipeline) == []
    assert not [n for n in list_segments() if any(f"-{pid}-" in n for pid in pids)]
