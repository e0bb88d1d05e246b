"""Speech request checks and capabilities, with no server: each mistake names its field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import cadence
from cadence.errors import InvalidParameter
from cadence.pipeline import PipelineConfig, StageConfig, load_pipeline_config
from cadence.serving.speech_chat import chat_audio, wants_audio
from cadence.serving.speech_serving import pipeline_capabilities, speech_params

PIPELINES = Path(cadence.__file__).parent / "pipeline" / "pipelines"


def test_a_speech_body_is_checked_and_resolved():
    params = speech_params(
        {"model": "tts-1", "input": "Hi.", "voice": "Nova", "speed": 2, "instructions": "calm"},
        100,
    )
    assert (params.text, params.voice, params.fmt, params.speed) == ("Hi.", "en-us+f3", "mp3", 2.0)
    assert params.media_type == "audio/mpeg"
    assert speech_params({"input": "Hi.", "stream_format": "sse"}, 100).media_type == (
        "text/event-stream"
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"input": None}, "input"),
        ({"input": "   "}, "input"),
        ({"input": "x" * 101}, "input"),
        ({"input": "x", "model": 3}, "model"),
        ({"input": "x", "voice": "zz"}, "voice"),
        ({"input": "x", "response_format": "ogg"}, "response_format"),
        ({"input": "x", "speed": 0}, "speed"),
        ({"input": "x", "stream_format": "raw"}, "stream_format"),
        ({"input": "x", "volume": 3}, "volume"),
    ],
)
def test_bad_speech_bodies_name_the_field(body, param):
    with pytest.raises(InvalidParameter) as e:
        speech_params(body, 100)
    assert e.value.param == param


def test_only_bodies_asking_for_audio_take_the_audio_path():
    assert wants_audio(b'{"modalities": ["text", "audio"], "messages": []}')
    assert not wants_audio(b'{"modalities": ["text"], "messages": []}')
    assert not wants_audio(b'{"messages": [{"role": "user", "content": "modalities"}]}')
    assert not wants_audio(b"{not json modalities")


def test_chat_audio_options():
    audio = chat_audio(
        {"modalities": ["text", "audio"], "audio": {"voice": "echo", "format": "pcm16"}}
    )
    assert (audio.voice, audio.fmt, audio.chat_format) == ("en", "pcm", "pcm16")
    for data, param in [
        ({"modalities": ["audio"], "audio": {"voice": "echo"}}, "modalities"),
        ({"modalities": ["text", "audio"]}, "audio"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "zz"}}, "audio"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "echo", "format": "au"}}, "audio"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "echo", "rate": 2}}, "audio"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "echo"}, "n": 2}, "n"),
    ]:
        with pytest.raises(InvalidParameter) as e:
            chat_audio(data)
        assert e.value.param == param, data


def test_capabilities_follow_the_declaration():
    speech = load_pipeline_config(str(PIPELINES / "speech.yaml"))
    assert pipeline_capabilities(speech) == {"speech", "audio_output"}
    colocated = load_pipeline_config(str(PIPELINES / "speech_colocated.yaml"))
    assert pipeline_capabilities(colocated) == {"speech", "audio_output"}
    # A thinker with an Engine of its own (a pipeline without a server): audio output only
    # when it loads an LLM.
    for llm, caps in [(True, {"speech", "audio_output"}), (False, {"speech"})]:
        engine = dataclasses.replace(
            speech,
            stages=tuple(
                dataclasses.replace(
                    s,
                    executor="cadence.engine_stage:EngineStage",
                    placement="process",
                    args={"llm": llm},
                )
                if s.name == "thinker"
                else s
                for s in speech.stages
            ),
        )
        assert pipeline_capabilities(engine) == caps
    other = PipelineConfig(stages=(StageConfig("only", "x.y:Z", terminal=True),))
    assert pipeline_capabilities(other) == set()
