"""The speech pipeline in stage processes over the shm relay, as a pipeline runs without a
Cadence server (the thinker `EngineStage`, an Engine of its own in a stage process; under a
server the thinker is the server's engine: tests/e2e/test_speech_e2e.py): each stage in its
own process, and talker + vocoder + encoder colocated; the thinker runs the real small model.
Every test ends with no stage holding state and no shared memory left."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from speech_checks import assert_speech, standalone_speech

from cadence.pipeline import Pipeline
from cadence.speech.executors import chat_request, speech_request

pytestmark = pytest.mark.slow

TEXT = "Hello from the speech pipeline. Each stage runs in a process of its own. Goodbye."


def _config(name: str, llm: bool):
    """The shipped declaration without a server: its thinker an Engine of its own."""
    return standalone_speech(name, llm=llm, engine_args={"max_total_tokens": 2048})


def _segments(pipeline) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if pipeline.pipeline_id in n]


async def _collect(coordinator, request, rid=None):
    audio, text, result, first_audio_at = [], [], None, None
    async for item in coordinator.stream(request, rid=rid):
        if item.is_final:
            result = item.data
        elif item.stage == "encoder":
            first_audio_at = first_audio_at or time.monotonic()
            audio.append(item.data["audio"])
        else:
            text.append(item.data["text"])
    return b"".join(audio), "".join(text), result, first_audio_at


async def _idle(pipeline) -> None:
    for _ in range(100):
        stats = await pipeline.coordinator.stage_stats()
        if all(not rids for s in stats.values() for rids in s.live.values()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"stage state left: {stats}")


@pytest.mark.parametrize("name", ["speech", "speech_colocated"])
async def test_speech_in_stage_processes(name):
    async with await Pipeline.start(_config(name, llm=False)) as pipeline:
        for fmt in ("mp3", "wav", "opus"):
            request = speech_request(TEXT * 4, "en-us", 1.0, fmt, True)
            audio, _, result, _ = await _collect(pipeline.coordinator, request)
            assert result["transcript"] == TEXT * 4
            assert_speech(audio, fmt, TEXT * 4)
        # Eight at once, and one abandoned midway.
        requests = [speech_request(TEXT, "en-us+f2", 1.5, "pcm", True) for _ in range(8)]
        results = await asyncio.gather(*(_collect(pipeline.coordinator, r) for r in requests))
        for audio, _, _, _ in results:
            assert_speech(audio, "pcm", TEXT, speed=1.5)
        stream = pipeline.coordinator.stream(speech_request(TEXT * 20, "en-us", 1.0, "pcm", True))
        async for item in stream:
            if item.stage == "encoder":
                break
        await stream.aclose()
        await _idle(pipeline)
        # Only the relay's slot pools (one per process) while it runs; nothing once it stops.
        assert all(n.endswith("-pool") for n in _segments(pipeline)), _segments(pipeline)
    assert _segments(pipeline) == []


async def test_chat_answer_spoken_by_the_real_model():
    async with await Pipeline.start(_config("speech", llm=True)) as pipeline:
        prompt = "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"
        request = chat_request(
            prompt, {"max_new_tokens": 48, "temperature": 0}, "en-us", "wav", False
        )
        audio, text, result, _ = await _collect(pipeline.coordinator, request)
        assert text.strip() and result["transcript"] == text
        assert_speech(audio, "wav", text)
        await _idle(pipeline)
    assert _segments(pipeline) == []
