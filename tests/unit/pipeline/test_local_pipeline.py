"""The stage runtime in one process (`LocalPipeline`): routing, fan-in, streams, failures
and aborts, with no sockets, relay or processes. Every test ends with no state held."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pipeline_graphs import GRAPHS, colocated, fan, linear, request, stream

from cadence.pipeline import LocalPipeline, PipelineConfig, StageConfig
from cadence.pipeline.errors import RequestAborted, StageFailed

E = "pipeline_executors:"


async def _start(config):
    return await LocalPipeline.start(config)


def _idle(pipeline) -> bool:
    return all(not rids for rids in pipeline.live().values()) and not pipeline.tracker.pending


async def _settle(pipeline) -> None:
    for _ in range(50):
        if _idle(pipeline):
            return
        await asyncio.sleep(0.01)
    assert _idle(pipeline), pipeline.live()


async def test_linear():
    p = await _start(linear())
    got = await p.submit(request(0, numel=4))
    assert torch.equal(got["x"], (torch.arange(4.0) + 1) * 2 + 3)
    assert got["trace"] == ["a", "b", "c"]
    await _settle(p)


async def test_fan_out_and_fan_in_with_merge():
    p = await _start(fan())
    got = await p.submit(request(0, numel=3))
    x = torch.arange(3.0) + 1
    assert torch.equal(got["x"], torch.cat([x * 2, -x]) + 0.5)
    assert got["trace"] == ["a", "b", "a", "c", "d"]
    await _settle(p)


async def test_a_stream_edge_and_the_client_stream():
    p = await _start(stream())
    items = [item async for item in p.stream(request(0, numel=2))]
    x = torch.arange(2.0) + 1
    chunks = [i for i in items if not i.is_final]
    assert [(i.stage, i.chunk_id) for i in chunks] == [("b", k) for k in range(4)]
    assert all(torch.equal(c.data["x"], x * (c.chunk_id + 1)) for c in chunks)
    final = items[-1]
    assert final.is_final and final.stage == "c"
    assert torch.equal(final.data["x"], x * 10) and final.data["n"] == [0, 1, 2, 3]
    await _settle(p)


async def test_stream_and_data_inputs_together():
    p = await _start(colocated())
    got = await p.submit(request(0, numel=2))
    assert torch.equal(got["x"], (torch.arange(2.0) + 1) * 6 * 3)
    await _settle(p)


async def test_several_terminals_give_one_result_each():
    config = PipelineConfig(
        stages=[
            StageConfig(name="a", executor=E + "Step", next=["b", "c"]),
            StageConfig(name="b", executor=E + "Step", args={"add": 1.0}, terminal=True),
            StageConfig(name="c", executor=E + "Step", args={"add": 2.0}, terminal=True),
        ]
    )
    p = await _start(config)
    got = await p.submit(request(0, numel=1))
    assert set(got) == {"b", "c"} and got["c"]["x"].item() == 2.0
    await _settle(p)


@pytest.mark.parametrize("graph", sorted(GRAPHS))
async def test_a_failing_stage_fails_only_its_request(graph):
    p = await _start(GRAPHS[graph]())
    stages = list(p.graph.stages)
    for stage in stages:
        bad = asyncio.ensure_future(p.submit(request(1, fail=stage)))
        good = asyncio.ensure_future(p.submit(request(2)))
        with pytest.raises(
            StageFailed, match=f"stage '{stage}' failed: ValueError: asked to fail at {stage}"
        ):
            await bad
        assert (await good)["x"].numel() > 0
        await _settle(p)


@pytest.mark.parametrize("status, param", [(429, None), (400, "max_tokens"), (503, None)])
async def test_a_refusal_a_stage_passes_on_keeps_its_status(status, param):
    """A stage whose engine refuses the request (429 at its limit, 400 naming a field) ends it
    with that refusal, not with a 500 of the stage's own."""
    p = await _start(linear())
    for stage in p.graph.stages:
        with pytest.raises(StageFailed) as caught:
            await p.submit(request(1, refuse=stage, status=status, param=param))
        error = caught.value
        assert (error.status, error.param) == (status, param)
        assert str(error) == f"{stage} refused with {status}"
        assert not error.is_request_fault
        assert (await p.submit(request(2)))["x"].numel() > 0
        await _settle(p)


@pytest.mark.parametrize("graph", sorted(GRAPHS))
async def test_an_abort_at_any_stage_leaves_nothing(graph):
    p = await _start(GRAPHS[graph]())
    for stage in p.graph.stages:
        task = asyncio.ensure_future(p.submit(request(0, block=stage), rid=f"r-{stage}"))
        for _ in range(100):
            await asyncio.sleep(0.001)
            if p.tracker.wire_of.get(f"r-{stage}") in p.live()[stage]:
                break
        assert p.abort(f"r-{stage}")
        with pytest.raises(RequestAborted):
            await task
        await _settle(p)
        assert not p.abort(f"r-{stage}")


async def test_a_caller_that_goes_away_aborts_its_request():
    p = await _start(linear())
    task = asyncio.ensure_future(p.submit(request(0, block="b"), rid="gone"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _settle(p)
    p = await _start(stream())
    agen = p.stream(request(0, block="c"), rid="left")
    first = await agen.__anext__()
    assert first.stage == "b" and "left" in p.tracker.wire_of
    await agen.aclose()
    assert "left" not in p.tracker.wire_of
    await _settle(p)


async def test_many_requests_at_once_stay_apart():
    p = await _start(fan())
    results = await asyncio.gather(*(p.submit(request(i, numel=5, sleep_ms=5)) for i in range(50)))
    for i, got in enumerate(results):
        x = torch.arange(5.0) + i + 1
        assert torch.equal(got["x"], torch.cat([x * 2, -x]) + 0.5)
    await _settle(p)


async def test_a_rid_can_be_reused_once_its_request_ended():
    p = await _start(linear())
    task = asyncio.ensure_future(p.submit(request(0, block="b"), rid="again"))
    await asyncio.sleep(0.01)
    p.abort("again")
    with pytest.raises(RequestAborted):
        await task
    got = await p.submit(request(0), rid="again")
    assert got["trace"] == ["a", "b", "c"]
    await _settle(p)


async def test_a_duplicate_rid_is_refused():
    p = await _start(linear())
    task = asyncio.ensure_future(p.submit(request(0, block="a"), rid="same"))
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="already in flight"):
        await p.submit(request(0), rid="same")
    p.abort("same")
    with pytest.raises(RequestAborted):
        await task
    await _settle(p)
