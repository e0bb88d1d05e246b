"""Chat answers spoken: /v1/chat/completions with `modalities: ["text", "audio"]` and
`audio: {voice, format}`, through the speech pipeline's thinker → talker → vocoder → encoder.

The chat is rendered to token ids here, by the same code as a text chat (template, tools,
sampling fields); the thinker generates from those ids, so the server's model and the
thinker's must be one: the shipped declarations' thinker generates with the server's own
engine, and a thinker with an Engine of its own must load the served model (a 400 says so
otherwise). Answers are OpenAI's:

- not streamed: `choices[0].message` has `content` and `audio` {id, data (base64 of the
  whole file), transcript (= content), expires_at};
- streamed: text deltas (`delta.content`) as the LLM writes them, interleaved with audio
  deltas (`delta.audio` {id, data}) as each sentence is encoded, and last a chunk whose
  `delta.audio` has {id, transcript, expires_at} and the finish_reason.

Text-only chat never comes here: `wants_audio` looks for the modality first.
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from cadence.errors import InvalidParameter
from cadence.serving import openai_protocol as proto
from cadence.serving.errors import decode_json
from cadence.serving.speech_serving import SpeechServing
from cadence.speech import voices
from cadence.speech.executors import chat_request

if TYPE_CHECKING:
    from cadence.serving.state import ServerState


class ChatServing(Protocol):
    """What chat with audio needs of the OpenAI chat serving (which calls in here)."""

    state: ServerState

    def check_model(self, model: str | None) -> None: ...

    def refuse_lora(self, model: str | None, lora_path: Any, what: str) -> None: ...

    async def chat_job(self, req: proto.ChatCompletionRequest) -> Any: ...


# OpenAI's chat audio formats -> the encoder's
CHAT_AUDIO_FORMATS = {
    "wav": "wav",
    "mp3": "mp3",
    "flac": "flac",
    "opus": "opus",
    "aac": "aac",
    "pcm16": "pcm",
}
MODALITIES = ("text", "audio")
AUDIO_TTL_S = 3600  # `expires_at`: the audio is not kept server-side; an hour, as OpenAI says


def wants_audio(body: bytes) -> bool:
    """Whether a chat body asks for audio output (cheap for bodies that do not)."""
    if b"modalities" not in body:
        return False
    try:
        data = decode_json(body)
    except InvalidParameter:
        return False  # the text path reports it
    modalities = data.get("modalities") if isinstance(data, dict) else None
    return isinstance(modalities, list) and "audio" in modalities


@dataclasses.dataclass(frozen=True)
class ChatAudio:
    voice: str  # eSpeak's
    fmt: str  # the encoder's
    chat_format: str  # as asked (pcm16 for pcm)


def chat_audio(data: dict) -> ChatAudio:
    """The checked `modalities` and `audio` of a chat body."""
    modalities = data.get("modalities")
    if not all(m in MODALITIES for m in modalities) or "text" not in modalities:
        raise InvalidParameter(
            "modalities", f'modalities must be ["text"] or ["text", "audio"], got {modalities!r}'
        )
    audio = data.get("audio")
    if not isinstance(audio, dict) or not isinstance(audio.get("voice"), str):
        raise InvalidParameter(
            "audio", 'audio output needs audio: {"voice": ..., "format": ...} (voice a string)'
        )
    unknown = sorted(set(audio) - {"voice", "format"})
    if unknown:
        raise InvalidParameter("audio", f"audio has unknown field(s) {', '.join(unknown)}")
    fmt = audio.get("format", "wav")
    if fmt not in CHAT_AUDIO_FORMATS:
        raise InvalidParameter(
            "audio", f"audio.format must be one of {', '.join(CHAT_AUDIO_FORMATS)}, got {fmt!r}"
        )
    try:
        voice = voices.resolve_voice(audio["voice"])
    except InvalidParameter as e:
        raise InvalidParameter("audio", f"audio.voice: {e}") from None
    try:
        voices.check_format(CHAT_AUDIO_FORMATS[fmt], "audio.format")
    except InvalidParameter as e:
        raise InvalidParameter("audio", str(e)) from None
    if data.get("n") not in (None, 1):
        raise InvalidParameter("n", "audio output answers one choice: give n 1 or none")
    return ChatAudio(voice, CHAT_AUDIO_FORMATS[fmt], fmt)


async def chat_with_audio(serving: ChatServing, body: bytes) -> dict | AsyncIterator[dict]:
    """A chat completion with audio: the response body, or the chunks of a streamed one (see
    the module docstring); raises InvalidParameter / RequestError before any is made."""
    data = decode_json(body)
    audio = chat_audio(data)
    _check_audio_output(serving)
    req = proto.parse_request(
        proto.ChatCompletionRequest,
        {k: v for k, v in data.items() if k not in ("modalities", "audio")},
    )
    serving.refuse_lora(req.model, req.lora_path, "chats with audio output")
    job = await serving.chat_job(req)  # rendered and checked as a text chat is
    request = chat_request(
        job.obj.input_ids, job.obj.sampling_params, audio.voice, audio.fmt, req.is_stream
    )
    items = serving.state.pipeline_client().stream(request, rid=job.id)
    answer = _Answer(job, audio)
    if req.is_stream:
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            first = None
        return answer.chunks(first, items)
    try:
        async for item in items:
            answer.take(item)
    finally:
        await items.aclose()  # a cancelled caller aborts every stage
    return answer.response()


def _check_audio_output(serving: ChatServing) -> None:
    state = serving.state
    if "audio_output" not in SpeechServing.declared(state):
        raise InvalidParameter(
            "modalities",
            "this server has no speech pipeline with an LLM, so it answers text only: start it "
            'with --pipeline speech, or drop "audio" from modalities',
        )
    if SpeechServing.thinker_is_the_server(state):
        return  # it generates with this server's engine: the model is the server's
    from cadence.model_loader.locate import resolve_model_path

    thinker = SpeechServing.thinker_model(state)
    served = resolve_model_path(state.args.model_path)
    if resolve_model_path(thinker) != served:
        raise InvalidParameter(
            "modalities",
            f"the speech pipeline's thinker runs {thinker or 'the default model'} but this server "
            f"serves {served}; set the thinker's model_path in the pipeline declaration to the "
            f"served model for chat with audio",
        )


class _Answer:
    """One chat-with-audio answer as its pipeline items arrive."""

    def __init__(self, job, audio: ChatAudio):
        self.job = job
        self.audio = audio
        self.audio_id = f"audio_{uuid.uuid4().hex}"
        self.text: list[str] = []
        self.data: list[bytes] = []
        self.meta: dict[str, Any] = {}
        self.result: dict | None = None

    def take(self, item) -> dict | None:
        """Records `item`; the delta it makes for a stream (None: none)."""
        if item.is_final:
            self.result = item.data
            return None
        if item.stage == "encoder":
            self.data.append(item.data["audio"])
            return {
                "audio": {
                    "id": self.audio_id,
                    "data": base64.b64encode(item.data["audio"]).decode(),
                }
            }
        self.meta.update(item.data.get("meta") or {})
        if item.data["text"]:
            self.text.append(item.data["text"])
            return {"content": item.data["text"]}
        return None

    @property
    def finish_reason(self) -> str | None:
        return proto.finish_reason(self.meta.get("finish_reason")) or "stop"

    @property
    def expires_at(self) -> int:
        return int(time.time()) + AUDIO_TTL_S

    def usage(self) -> dict:
        return proto.usage(
            self.meta.get("prompt_tokens") or 0, self.meta.get("completion_tokens") or 0, 0
        )

    def response(self) -> dict:
        text = "".join(self.text)
        message = {
            "role": "assistant",
            "content": text,
            "audio": {
                "id": self.audio_id,
                "data": base64.b64encode(b"".join(self.data)).decode(),
                "transcript": text,
                "expires_at": self.expires_at,
            },
        }
        return {
            "id": self.job.id,
            "object": "chat.completion",
            "created": self.job.created,
            "model": self.job.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                }
            ],
            "usage": self.usage(),
        }

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return {
            "id": self.job.id,
            "object": "chat.completion.chunk",
            "created": self.job.created,
            "model": self.job.model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }

    async def chunks(self, first, items: AsyncIterator) -> AsyncIterator[dict]:
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            if first is not None:
                delta = self.take(first)
                if delta:
                    yield self._chunk(delta)
            async for item in items:
                delta = self.take(item)
                if delta:
                    yield self._chunk(delta)
            last = {
                "audio": {
                    "id": self.audio_id,
                    "transcript": "".join(self.text),
                    "expires_at": self.expires_at,
                }
            }
            yield self._chunk(last, self.finish_reason)
            if self.job.req.include_usage:
                yield {**self._chunk({}), "choices": [], "usage": self.usage()}
        finally:
            await items.aclose()
