"""Linear, fan-out + fan-in, a stream edge and colocated stages, each over shm and torch:
stage processes give what the same graph gives in one process (`LocalPipeline`), to the
byte, and hold nothing afterwards."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pipeline_checks import assert_clean
from pipeline_graphs import GRAPHS, request

from cadence.pipeline import LocalPipeline, Pipeline, RelayConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# Every payload with tensors goes through the relay; slots of 64 KiB, so a large request
# (256 K floats, 1 MiB) takes a dedicated segment on shm.
RELAYS = {
    "shm": RelayConfig(backend="shm", slot_mb=1 / 16, credits=4, inline_max_bytes=0),
    "torch": RelayConfig(backend="torch", inline_max_bytes=0),
}
SIZES = [1, 2048, 300, 1 << 18, 7, 2048, 0, 4096]


def _requests():
    return [request(i, numel=SIZES[i % len(SIZES)]) for i in range(16)]


def _assert_same(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)
    else:
        assert got == want


async def _reference(config, requests):
    local = await LocalPipeline.start(config)
    try:
        results = [await local.submit(r) for r in requests]
        streams = []
        if config.graph.client_streams:
            streams = [[(i.stage, i.chunk_id, i.data) async for i in local.stream(requests[0])]]
        return results, streams
    finally:
        await local.close()


@pytest.mark.parametrize("backend", sorted(RELAYS))
@pytest.mark.parametrize("graph", sorted(GRAPHS))
async def test_processes_match_one_process(graph, backend, no_leftover_segments):
    config = GRAPHS[graph](RELAYS[backend])
    requests = _requests()
    want, want_streams = await _reference(config, requests)
    pipeline = await Pipeline.start(config)
    no_leftover_segments.append(pipeline)
    try:
        got = await asyncio.gather(*(pipeline.coordinator.submit(r) for r in requests))
        for g, w in zip(got, want):
            _assert_same(g, w)
        if want_streams:
            items = [
                (i.stage, i.chunk_id, i.data)
                async for i in pipeline.coordinator.stream(requests[0])
            ]
            _assert_same(items, want_streams[0])
        await assert_clean(pipeline)
    finally:
        await pipeline.shutdown()


async def test_small_payloads_inline_and_a_single_process(no_leftover_segments):
    """Default relay settings (small tensors inline in DataReady), and a pipeline whose
    stages all share one process (no relay at all)."""
    from pipeline_graphs import fan

    requests = [request(i, numel=16) for i in range(8)]
    want, _ = await _reference(fan(), requests)
    config = fan()
    single = type(config)(
        name="single",
        stages=[
            type(s)(**{**s.__dict__, "colocate_with": tuple(n for n in "abcd" if n != s.name)})
            for s in config.stages
        ],
    )
    for cfg in (config, single):
        pipeline = await Pipeline.start(cfg)
        no_leftover_segments.append(pipeline)
        try:
            got = await asyncio.gather(*(pipeline.coordinator.submit(r) for r in requests))
            for g, w in zip(got, want):
                _assert_same(g, w)
            await assert_clean(pipeline)
        finally:
            await pipeline.shutdown()
    assert single.graph.processes == ("a+b+c+d",)
