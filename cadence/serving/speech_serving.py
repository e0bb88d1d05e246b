"""Speech over any protocol: checking a /v1/audio/speech request, running it through the
`speech` pipeline of --pipeline, and what the server says it can do (`capabilities`).

The HTTP route and the gRPC SynthesizeSpeech RPC both call `SpeechServing`; a request is
checked here once (each mistake an InvalidParameter naming its field) before the pipeline
sees it. A server without a speech pipeline refuses speech with a 400 that says how to
start one.
"""

from __future__ import annotations

import base64
import functools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cadence.errors import InvalidParameter
from cadence.serving.body import json_object
from cadence.serving.state import ServerState
from cadence.speech import voices

SPEECH_EXECUTORS = ("cadence.speech.executors:Vocoder", "cadence.speech.executors:Encoder")
THINKER = "cadence.engine_stage:EngineStage"  # an Engine of its own (model_path, llm args)
SERVER_THINKER = "cadence.serving.client_stage:EngineClientStage"  # the server's own model
SPEECH_FIELDS = ("model", "input", "voice", "response_format", "speed", "stream_format")
IGNORED_FIELDS = ("instructions",)  # OpenAI's steering prompt for its own voices: no effect


# The body of /v1/audio/speech, for the OpenAPI document.
SPEECH_SCHEMA = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "input": {"type": "string", "minLength": 1},
        "voice": {"type": "string", "default": voices.DEFAULT_VOICE},
        "response_format": {"enum": list(voices.FORMATS), "default": "mp3"},
        "speed": {
            "type": "number",
            "minimum": voices.MIN_SPEED,
            "maximum": voices.MAX_SPEED,
            "default": 1.0,
        },
        "stream_format": {"enum": list(voices.STREAM_FORMATS), "default": "audio"},
        "instructions": {"type": "string", "description": "Accepted; eSpeak NG ignores it."},
    },
    "required": ["input"],
}


@dataclass(frozen=True)
class SpeechParams:
    """A checked speech request."""

    text: str
    voice: str  # the eSpeak voice (language[+variant])
    fmt: str  # a key of voices.FORMATS
    speed: float
    stream_format: str  # "audio" (the format's bytes) or "sse" (base64 in events)

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.stream_format == "sse" else voices.FORMATS[self.fmt][0]


def speech_params(body: Any, max_chars: int) -> SpeechParams:
    """The checked fields of a /v1/audio/speech body (a JSON object)."""
    json_object(body)
    unknown = sorted(set(body) - set(SPEECH_FIELDS) - set(IGNORED_FIELDS))
    if unknown:
        raise InvalidParameter(
            unknown[0], f"unknown field(s) {', '.join(unknown)}; known: {', '.join(SPEECH_FIELDS)}"
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidParameter("model", f"model must be a string, got {model!r}")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise InvalidParameter("input", "input must be a non-empty string: the text to speak")
    if len(text) > max_chars:
        raise InvalidParameter(
            "input",
            f"input is {len(text)} characters; this server speaks at most {max_chars} "
            f"(--max-speech-chars): split the text",
        )
    stream_format = body.get("stream_format", "audio")
    if stream_format not in voices.STREAM_FORMATS:
        raise InvalidParameter(
            "stream_format", f"stream_format must be audio or sse, got {stream_format!r}"
        )
    return SpeechParams(
        text=text,
        voice=voices.resolve_voice(body.get("voice")),
        fmt=voices.check_format(body.get("response_format")),
        speed=voices.check_speed(body.get("speed")),
        stream_format=stream_format,
    )


def pipeline_capabilities(config) -> set[str]:
    """What a pipeline declaration adds to a server: speech with a vocoder and an encoder,
    audio output with a thinker that runs an LLM too (the server's, or one of its own)."""
    executors = {s.executor: s for s in config.stages}
    if not all(e in executors for e in SPEECH_EXECUTORS):
        return set()
    caps = {"speech"}
    thinker = executors.get(THINKER)
    if SERVER_THINKER in executors or (thinker is not None and thinker.args.get("llm", True)):
        caps.add("audio_output")
    return caps


@functools.cache
def _declaration(pipeline_path: str) -> tuple[frozenset[str], str | None, bool]:
    """A declaration's capabilities, the model_path of a thinker with an Engine of its own
    (None: the default model), and whether its thinker is the server's own engine."""
    from cadence.pipeline import load_pipeline_config

    config = load_pipeline_config(pipeline_path)
    thinkers = [s for s in config.stages if s.executor == THINKER]
    model = thinkers[0].args.get("model_path") if thinkers else None
    is_server = any(s.executor == SERVER_THINKER for s in config.stages)
    return frozenset(pipeline_capabilities(config)), model, is_server


def server_capabilities(state: ServerState) -> list[str]:
    """What this server serves, in the router's vocabulary (cadence.router.config): GET
    /capabilities, and the `capabilities` of each /v1/models card."""
    client = getattr(state, "client", None)
    info = client.info if client is not None else None
    caps = set(SpeechServing.declared(state))
    if info is None or info.is_generation:
        caps.update(("chat", "completion", "streaming"))
    else:
        caps.add("embedding")
    return sorted(caps)


class SpeechServing:
    """/v1/audio/speech for one front process."""

    def __init__(self, state: ServerState):
        self.state = state
        self.pipeline_caps = self.declared(state)

    @staticmethod
    def declared(state: ServerState) -> frozenset[str]:
        """The capabilities --pipeline's declaration adds (none without one)."""
        if getattr(state.args, "pipeline", None) is None:
            return frozenset()
        return _declaration(state.args.pipeline_path)[0]

    @staticmethod
    def thinker_model(state: ServerState) -> str | None:
        """The model_path of --pipeline's thinker (None: the default model)."""
        return _declaration(state.args.pipeline_path)[1]

    @staticmethod
    def thinker_is_the_server(state: ServerState) -> bool:
        """--pipeline's thinker generates with the server's own engine (so with its model)."""
        return _declaration(state.args.pipeline_path)[2]

    def check_speech(self, capability: str = "speech", field: str | None = None) -> None:
        if capability not in self.pipeline_caps:
            how = (
                "start it with --pipeline speech"
                if capability == "speech"
                else "start it with --pipeline speech (whose thinker runs the LLM)"
            )
            raise InvalidParameter(
                field, f"this server has no speech pipeline for {capability}; {how}"
            )

    async def synthesize(self, params: SpeechParams) -> AsyncIterator[bytes]:
        """The audio's bytes as the encoder sends them; leaving early aborts every stage."""
        self.check_speech()
        from cadence.speech.executors import speech_request

        client = self.state.pipeline_client()
        request = speech_request(params.text, params.voice, params.speed, params.fmt, True)
        async for item in client.stream(request, rid=f"speech-{uuid.uuid4().hex}"):
            if item.stage == "encoder" and not item.is_final:
                yield item.data["audio"]

    async def synthesize_events(self, params: SpeechParams) -> AsyncIterator[dict]:
        """`stream_format: sse`: speech.audio.delta events (base64 audio), then
        speech.audio.done."""
        async for audio in self.synthesize(params):
            yield {"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()}
        yield {"type": "speech.audio.done"}
