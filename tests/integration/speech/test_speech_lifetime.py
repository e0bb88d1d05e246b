"""Lifetime of the speech pipeline in stage processes, run without a server (its thinker an
Engine of its own, `EngineStage`): 200 requests (speech and chat with audio), about half
abandoned by their client mid-stream, leave no stage request state, no per-request shared
memory and no KV pages in the thinker's engine; a SIGKILLed vocoder is noticed at once and
reported (503 naming it), not hung on, and the restarted stage serves."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from speech_checks import assert_speech, standalone_speech

from cadence.pipeline import Pipeline
from cadence.pipeline.errors import PipelineUnavailable
from cadence.speech.executors import chat_request, speech_request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_REQUESTS = 200
CONCURRENCY = 8
TEXT = "One sentence comes first. Another follows it. And a third ends the text."
PROMPT = "<|im_start|>user\nName a few birds.<|im_end|>\n<|im_start|>assistant\n"
FORMATS = ("mp3", "wav", "pcm", "opus", "aac", "flac")


def _config():
    """The shipped declaration without a server: its thinker an Engine of its own."""
    engine_args = {"max_total_tokens": 2048, "max_running_requests": 8}
    return standalone_speech("speech", llm=True, engine_args=engine_args)


def _request(rng: random.Random) -> dict:
    fmt = rng.choice(FORMATS)
    if rng.random() < 0.15:
        return chat_request(PROMPT, {"max_new_tokens": 24}, "en-us", fmt, True)
    return speech_request(TEXT * rng.randint(1, 4), "en-us+f2", rng.uniform(0.5, 2.0), fmt, True)


async def _one(coordinator, request: dict, leave_after: int | None) -> str:
    """Reads the stream; leaves it after `leave_after` items (None: reads it all)."""
    stream = coordinator.stream(request)
    seen = 0
    try:
        async for _ in stream:
            seen += 1
            if leave_after is not None and seen >= leave_after:
                return "left"
    finally:
        await stream.aclose()
    return "done"


async def _live(pipeline) -> dict[str, list[str]]:
    stats = await pipeline.coordinator.stage_stats()
    return {stage: rids for s in stats.values() for stage, rids in s.live.items() if rids}


async def _engine_load(pipeline) -> dict:
    request = {
        "engine_load": True,
        "options": {"voice": "en-us", "speed": 1.0, "format": "pcm", "streaming": True},
    }
    async for item in pipeline.coordinator.stream(request):
        if item.stage == "thinker" and "meta" in item.data:
            return item.data["meta"]
    raise AssertionError("the thinker did not report its load")


def _segments(pipeline) -> list[str]:
    pids = {str(p.pid) for p in pipeline.processes.values()} | {str(os.getpid())}
    return [
        n
        for n in os.listdir("/dev/shm")
        if n.startswith("cadence-relay-") and n.split("-")[2] in pids and not n.endswith("-pool")
    ]


async def test_abandoned_requests_leave_nothing_behind_and_a_killed_vocoder_is_reported():
    rng = random.Random(19)
    plan = [
        (_request(rng), rng.randint(1, 4) if rng.random() < 0.5 else None)
        for _ in range(NUM_REQUESTS)
    ]
    async with await Pipeline.start(_config(), restart_stages=True) as pipeline:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def run(request, leave_after):
            async with gate:
                return await _one(pipeline.coordinator, request, leave_after)

        outcomes = await asyncio.gather(*(run(r, k) for r, k in plan))
        assert outcomes.count("left") > NUM_REQUESTS // 4 and outcomes.count("done") > 50
        for _ in range(100):
            if not await _live(pipeline):
                break
            await asyncio.sleep(0.05)
        assert await _live(pipeline) == {}
        assert _segments(pipeline) == []
        load = await _engine_load(pipeline)
        assert load == {"num_used_tokens": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}

        # A SIGKILLed vocoder, mid-request: the request fails at once, naming it.
        long_text = " ".join(["This request is under way when its vocoder dies."] * 30)
        stream = pipeline.coordinator.stream(speech_request(long_text, "en-us", 0.5, "pcm", True))
        await stream.__anext__()
        vocoder = pipeline.processes["vocoder"]
        started = time.monotonic()
        os.kill(vocoder.pid, signal.SIGKILL)
        with pytest.raises(PipelineUnavailable, match="vocoder.*SIGKILL"):
            async for _ in stream:
                pass
        assert time.monotonic() - started < 5
        for _ in range(600):  # restarted: healthy again
            if pipeline.coordinator.is_healthy:
                break
            await asyncio.sleep(0.05)
        assert pipeline.coordinator.is_healthy
        audio = []
        async for item in pipeline.coordinator.stream(
            speech_request(TEXT, "en-us", 1.0, "pcm", True)
        ):
            if item.stage == "encoder" and not item.is_final:
                audio.append(item.data["audio"])
        assert_speech(b"".join(audio), "pcm", TEXT)
    assert _segments(pipeline) == []
    assert not [n for n in os.listdir("/dev/shm") if pipeline.pipeline_id in n]
