"""The speech stages in one process (`LocalPipeline`): text in, a format's bytes out, chunk by
chunk; the thinker runs no LLM here (the integration tests run the real one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from speech_checks import assert_speech, decode, standalone_speech

import cadence
from cadence.pipeline import LocalPipeline, load_pipeline_config
from cadence.pipeline.errors import StageFailed
from cadence.speech.executors import speech_request
from cadence.speech.voices import FORMATS

PIPELINES = Path(cadence.__file__).parent / "pipeline" / "pipelines"
TEXT = (
    "Speech starts with the first sentence. The second one follows while the first plays. "
    "And a third closes the answer."
)


def speech_config(name: str = "speech"):
    """The shipped declaration as a pipeline without a server, its thinker's LLM off."""
    return standalone_speech(name, llm=False)


@pytest.fixture
async def pipeline():
    p = await LocalPipeline.start(speech_config())
    yield p
    await p.close()


async def _collect(pipeline, request):
    audio, text, result = [], [], None
    async for item in pipeline.stream(request):
        if item.is_final:
            result = item.data
        elif item.stage == "encoder":
            audio.append(item.data["audio"])
        else:
            text.append(item.data["text"])
    return audio, "".join(text), result


@pytest.mark.parametrize("fmt", ["mp3", "wav", "flac", "pcm", "opus", "aac"])
async def test_text_becomes_speech_in_every_format(pipeline, fmt):
    audio, text, result = await _collect(pipeline, speech_request(TEXT, "en-us", 1.0, fmt, True))
    assert text == TEXT
    assert result["transcript"] == TEXT and result["format"] == fmt
    seconds = assert_speech(b"".join(audio), fmt, TEXT)
    assert seconds == pytest.approx(result["duration_s"], abs=0.15)
    if fmt in ("mp3", "wav", "pcm"):
        assert len(audio) >= 3, "one chunk per sentence at least"
    assert all(not rids for rids in pipeline.live().values())


async def test_speed_and_voice_reach_the_vocoder(pipeline):
    _, _, normal = await _collect(pipeline, speech_request(TEXT, "en-us", 1.0, "pcm", True))
    _, _, fast = await _collect(pipeline, speech_request(TEXT, "en-us+f3", 2.0, "pcm", True))
    assert normal["duration_s"] / fast["duration_s"] == pytest.approx(2.0, rel=0.2)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("text", ["...", "?", "\U0001f600"])
async def test_nothing_to_say_is_a_valid_file_of_every_format(pipeline, text, fmt):
    audio, _, result = await _collect(pipeline, speech_request(text, "en-us", 1.0, fmt, True))
    assert result["num_samples"] == 0 and result["transcript"] == text
    samples, _ = decode(b"".join(audio), fmt)
    assert np.abs(samples).max(initial=0.0) < 0.01  # silence (lossy codecs: near 0)


async def test_a_chat_request_without_an_llm_fails_naming_the_stage(pipeline):
    from cadence.speech.executors import chat_request

    with pytest.raises(StageFailed, match="thinker.*runs no LLM"):
        await pipeline.submit(chat_request("Hi", {}, "en-us", "mp3", True))


async def test_leaving_a_stream_early_stops_every_stage(pipeline):
    long_text = " ".join(["This sentence is one of many in a long text."] * 40)
    stream = pipeline.stream(speech_request(long_text, "en-us", 1.0, "pcm", True), rid="early")
    async for item in stream:
        if item.stage == "encoder":
            break
    await stream.aclose()
    for _ in range(100):
        if all(not rids for rids in pipeline.live().values()):
            break
        await asyncio.sleep(0.01)
    assert all(not rids for rids in pipeline.live().values()), pipeline.live()
    assert not pipeline.abort("early")  # nothing left in flight under that rid


def test_the_shipped_thinker_is_the_servers_engine_in_the_front():
    for name, processes in [
        ("speech", ("talker", "vocoder", "encoder")),
        ("speech_colocated", ("encoder+talker+vocoder",)),
    ]:
        graph = load_pipeline_config(str(PIPELINES / f"{name}.yaml")).graph
        assert graph.front_stages == ("thinker",) and graph.processes == processes
        assert graph.stages["thinker"].executor == "cadence.serving.client_stage:EngineClientStage"


async def test_colocated_variant_runs_the_same_stages_in_two_processes(pipeline):
    config = speech_config("speech_colocated")
    assert config.graph.processes == ("thinker", "encoder+talker+vocoder")
    colocated = await LocalPipeline.start(config)
    try:
        request = speech_request(TEXT, "en-us", 1.0, "wav", False)
        _, _, a = await _collect(pipeline, request)
        _, _, b = await _collect(colocated, request)
        # eSpeak may differ by a few samples from one call to the next (its state carries).
        assert a["duration_s"] == pytest.approx(b["duration_s"], abs=0.01)
    finally:
        await colocated.close()
