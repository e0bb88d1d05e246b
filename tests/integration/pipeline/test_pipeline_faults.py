"""Faults: an exception fails its request only; a stage that cannot start is named with its
error; a stage process killed mid-transfer fails what is in flight within a second, makes
the pipeline unhealthy, and is either restarted (then everything works and nothing leaked)
or ends the pipeline (`failed`, on which the server exits non-zero); a SIGKILLed launcher
takes its stage processes along. Never a hang."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest
from launcher_peer import run_launcher
from pipeline_checks import assert_clean, segments_of
from pipeline_graphs import E, linear, request

from cadence.liveness import is_alive
from cadence.pipeline import Pipeline, PipelineConfig, RelayConfig, StageConfig
from cadence.pipeline.errors import PipelineStartError, PipelineUnavailable, StageFailed
from cadence.pipeline.relay.shm import list_segments

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SHM = RelayConfig(backend="shm", slot_mb=1 / 16, credits=4, inline_max_bytes=0)
TORCH = RelayConfig(backend="torch", inline_max_bytes=0)


@pytest.mark.parametrize("relay", [SHM, TORCH], ids=["shm", "torch"])
async def test_an_exception_fails_only_its_request(relay, no_leftover_segments):
    pipeline = await Pipeline.start(linear(relay))
    no_leftover_segments.append(pipeline)
    try:
        submit = pipeline.coordinator.submit
        calls = [submit(request(i, fail=s)) for i, s in enumerate("abc")]
        # A refusal passed on (the engine of a stage at its limit, or naming a bad field)
        # crosses the processes with its status and field.
        calls += [submit(request(5, refuse="b", status=429))]
        calls += [submit(request(6, refuse="c", status=400, param="max_tokens"))]
        calls += [submit(request(10 + i)) for i in range(6)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for stage, error in zip("abc", results[:3]):
            assert isinstance(error, StageFailed) and error.status == 500
            assert str(error) == f"stage '{stage}' failed: ValueError: asked to fail at {stage}"
        busy, invalid = results[3:5]
        assert (busy.status, busy.param, str(busy)) == (429, None, "b refused with 429")
        assert (invalid.status, invalid.param) == (400, "max_tokens")
        assert all(isinstance(r, dict) for r in results[5:])
        assert pipeline.coordinator.is_healthy
        await assert_clean(pipeline)
    finally:
        await pipeline.shutdown()


@pytest.mark.parametrize(
    "executor, message",
    [
        ("BrokenSetup", "stage process b failed to start: RuntimeError: the weights are missing"),
        ("NotAnExecutor", "stage 'b': pipeline_executors:NotAnExecutor returned a NotAnExecutor"),
        ("Missing", "AttributeError: module 'pipeline_executors' has no attribute 'Missing'"),
    ],
)
async def test_a_stage_that_cannot_start_is_named(executor, message):
    config = PipelineConfig(
        stages=[
            StageConfig(name="a", executor=E + "Step", next="b"),
            StageConfig(name="b", executor=E + executor, terminal=True),
        ],
        relay=SHM,
    )
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(PipelineStartError, match=message):
        await Pipeline.start(config)
    assert {n for n in os.listdir("/dev/shm") if n.startswith("cadence-relay-")} <= before


def _died(error, victim: str) -> bool:
    """How a request in flight to a killed stage fails: the launcher's notice naming the
    process, or (torch, whose connections notice first) the transfer to it, naming it."""
    if isinstance(error, PipelineUnavailable):
        return f"stage process {victim} " in str(error) and "killed by SIGKILL" in str(error)
    return isinstance(error, StageFailed) and f"to stage '{victim}' failed" in str(error)


async def _kill_mid_transfer(pipeline, victim: str) -> tuple[list, float]:
    """Requests stalled at `victim` (its loop blocked, so upstream transfers to it stay
    unread), then SIGKILL; returns the outcomes and how long the last one took to fail."""
    submit = pipeline.coordinator.submit
    calls = [
        asyncio.ensure_future(submit(request(i, numel=1 << 16, stall=victim))) for i in range(3)
    ]
    calls += [asyncio.ensure_future(submit(request(10 + i, numel=1 << 16))) for i in range(3)]
    await asyncio.sleep(0.5)
    assert not any(c.done() for c in calls)
    os.kill(pipeline.processes[victim].pid, signal.SIGKILL)
    killed = time.monotonic()
    results = await asyncio.gather(*calls, return_exceptions=True)
    return results, time.monotonic() - killed


async def test_a_killed_stage_ends_the_pipeline_without_restart(no_leftover_segments):
    pipeline = await Pipeline.start(linear(SHM))
    no_leftover_segments.append(pipeline)
    try:
        results, waited = await _kill_mid_transfer(pipeline, "b")
        assert waited < 1.0
        for error in results:
            assert isinstance(error, PipelineUnavailable) and error.status == 503
            assert "stage process b (stages: b; pid" in str(error) and "killed by SIGKILL" in str(
                error
            )
        assert pipeline.failed.is_set() and "restarting stages is off" in pipeline.failure
        assert not pipeline.coordinator.is_healthy
        with pytest.raises(PipelineUnavailable, match="cannot take requests"):
            await pipeline.coordinator.submit(request(0))
        dead_pid = pipeline.processes["b"].pid
        assert not [n for n in segments_of(pipeline) if f"-{dead_pid}-" in n]  # swept
    finally:
        await pipeline.shutdown()


@pytest.mark.parametrize("relay", [SHM, TORCH], ids=["shm", "torch"])
async def test_a_killed_stage_is_restarted(relay, no_leftover_segments):
    pipeline = await Pipeline.start(linear(relay), restart_stages=True)
    no_leftover_segments.append(pipeline)
    try:
        pids = {name: proc.pid for name, proc in pipeline.processes.items()}
        results, waited = await _kill_mid_transfer(pipeline, "b")
        assert waited < 1.0
        assert all(_died(r, "b") for r in results), results
        for _ in range(200):
            if pipeline.coordinator.is_healthy:
                break
            await asyncio.sleep(0.05)
        assert pipeline.coordinator.is_healthy and not pipeline.failed.is_set()
        new_pids = {name: proc.pid for name, proc in pipeline.processes.items()}
        assert new_pids["b"] != pids["b"]
        if relay.backend == "torch":  # the group is rebuilt: every process is new
            assert all(new_pids[n] != pids[n] for n in pids)
        else:
            assert new_pids["a"] == pids["a"] and new_pids["c"] == pids["c"]
        got = await asyncio.gather(*(pipeline.coordinator.submit(request(i)) for i in range(8)))
        assert [g["trace"] for g in got] == [["a", "b", "c"]] * 8
        await assert_clean(pipeline)
    finally:
        await pipeline.shutdown()


async def test_a_killed_launcher_takes_its_stage_processes_along():
    """Under forkserver a stage's parent is the fork server, which outlives a SIGKILLed
    launcher as long as its children do: the stages watch the launcher themselves."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    launcher = ctx.Process(target=run_launcher, args=(writer,))
    launcher.start()
    pids: list[int] = []
    try:
        assert await asyncio.to_thread(reader.poll, 60), "the pipeline did not start"
        pids = reader.recv()
        with open(f"/proc/{pids[0]}/stat") as f:
            pids.append(int(f.read().rsplit(")", 1)[1].split()[1]))  # the fork server
        os.kill(launcher.pid, signal.SIGKILL)
        await asyncio.to_thread(launcher.join, 5)
        deadline = time.monotonic() + 10
        while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not [p for p in pids if is_alive(p)]
        assert not [n for n in list_segments() if any(f"-{p}-" in n for p in pids)]
    finally:
        for pid in [launcher.pid, *pids]:
            if pid and is_alive(pid):
                os.kill(pid, signal.SIGKILL)
