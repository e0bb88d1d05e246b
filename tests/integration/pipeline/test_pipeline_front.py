"""Stages placed in the front (`placement: front`) run in the process that started the
pipeline, beside its coordinator, with what that process hands them (`services`). Requests,
streams and aborts pass between them and the stage processes as between processes (the
`front` graph of test_pipeline_graphs.py checks the results against one process); an abort
at any stage, or a stage process's death, leaves no request state in the front or anywhere."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal

import pytest
from pipeline_checks import assert_clean
from pipeline_graphs import E, front, request

from cadence.pipeline import Pipeline, PipelineConfig, RelayConfig, StageConfig
from cadence.pipeline.config import FRONT
from cadence.pipeline.errors import PipelineStartError, PipelineUnavailable, RequestAborted

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SHM = RelayConfig(backend="shm", slot_mb=1 / 16, credits=4, inline_max_bytes=0)


async def _held(pipeline, stage: str, rid: str) -> None:
    """Waits until `stage` holds the request the caller knows as `rid`."""
    for _ in range(400):
        wire = pipeline.coordinator.tracker.wire_of.get(rid)
        stats = await pipeline.coordinator.stage_stats()
        if any(wire in s.live.get(stage, ()) for s in stats.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"stage {stage} never held {rid}")


async def test_an_abort_at_any_stage_leaves_nothing_in_the_front(no_leftover_segments):
    pipeline = await Pipeline.start(front(SHM))
    no_leftover_segments.append(pipeline)
    try:
        assert pipeline.graph.processes == ("b", "c")
        result = await pipeline.coordinator.submit(request(1, numel=1 << 18))  # 1 MiB inline
        assert result["trace"] == ["c", "d"]  # c starts a trace of its own
        for stage in "abcd":
            rid = f"r-{stage}"
            task = asyncio.ensure_future(
                pipeline.coordinator.submit(request(0, block=stage), rid=rid)
            )
            await _held(pipeline, stage, rid)
            assert pipeline.coordinator.abort(rid)
            with pytest.raises(RequestAborted):
                await task
            await assert_clean(pipeline)
        stats = await pipeline.coordinator.stage_stats()
        assert stats[FRONT].pid == os.getpid() and stats[FRONT].live == {"a": [], "d": []}
    finally:
        await pipeline.shutdown()


async def test_a_dead_stage_process_drops_what_the_front_holds(no_leftover_segments):
    pipeline = await Pipeline.start(front(SHM), restart_stages=True)
    no_leftover_segments.append(pipeline)
    try:
        task = asyncio.ensure_future(pipeline.coordinator.submit(request(0, block="a"), rid="r"))
        await _held(pipeline, "a", "r")
        os.kill(pipeline.processes["c"].pid, signal.SIGKILL)
        with pytest.raises(PipelineUnavailable, match="stage process c .*SIGKILL"):
            await task
        assert pipeline.coordinator.front.live() == {"a": [], "d": []}
        for _ in range(400):
            if pipeline.coordinator.is_healthy:
                break
            await asyncio.sleep(0.025)
        assert pipeline.coordinator.is_healthy
        assert (await pipeline.coordinator.submit(request(2)))["trace"] == ["c", "d"]
        await assert_clean(pipeline)
    finally:
        await pipeline.shutdown()


def _echo_config(front_executor: str = "ServiceEcho") -> PipelineConfig:
    return PipelineConfig(
        stages=[
            StageConfig(name="a", executor=E + front_executor, next="b", placement="front"),
            StageConfig(name="b", executor=E + "ServiceEcho", terminal=True),
        ],
        relay=SHM,
    )


async def test_front_stages_get_the_services_and_may_wait_for_them():
    handed = asyncio.get_running_loop().create_future()
    start = asyncio.ensure_future(Pipeline.start(_echo_config(), services={"tag": handed}))
    await asyncio.sleep(0.5)
    assert not start.done()  # the front stage waits for its service
    handed.set_result("the server's")
    pipeline = await start
    try:
        front_result = await pipeline.coordinator.submit(request(0))
        # b (a stage process) got no service: services never cross processes.
        assert front_result["service"] is None and front_result["own_process"] is True
        assert pipeline.coordinator.front.executors["a"].value == "the server's"
        assert pipeline.coordinator.front.executors["a"].own_process is False
    finally:
        await pipeline.shutdown()


async def test_a_front_stage_that_cannot_start_is_named_and_nothing_is_left():
    before = {p.pid for p in mp.active_children()}
    with pytest.raises(
        PipelineStartError,
        match="stage a \\(placed in the front\\) failed to start: RuntimeError: the weights",
    ):
        await Pipeline.start(_echo_config("BrokenSetup"))
    assert {p.pid for p in mp.active_children()} <= before  # b's process is stopped


class _Awaited:
    """A service that tells when a front stage starts waiting for it, and never comes."""

    def __init__(self) -> None:
        self.waited_for = asyncio.Event()
        self._never = asyncio.get_running_loop().create_future()

    def __await__(self):
        self.waited_for.set()
        return self._never.__await__()


async def test_a_stage_process_lost_while_the_front_waits_fails_the_start():
    """A front stage may wait for its service (a server's model still loading): a stage
    process that dies meanwhile is noticed then, not once the service comes."""
    before = {p.pid for p in mp.active_children()}
    service = _Awaited()
    start = asyncio.ensure_future(Pipeline.start(_echo_config(), services={"tag": service}))
    async with asyncio.timeout(60):
        await service.waited_for.wait()  # every stage process is ready by then
    (stage,) = [p for p in mp.active_children() if p.pid not in before and p.name == "b"]
    os.kill(stage.pid, signal.SIGKILL)
    async with asyncio.timeout(5):
        with pytest.raises(PipelineStartError, match="stage process b .*SIGKILL"):
            await start
    assert {p.pid for p in mp.active_children()} <= before
