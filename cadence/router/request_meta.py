"""What the router reads from a request body: only what routing needs.

The body is forwarded untouched; this module decodes a lean view of it (model, stream,
modalities, the kinds of content parts, the prompt prefix) with msgspec, which skips
every other field without building Python objects for it. A body that does not fit
the view (not JSON, not UTF-8, nested too deeply, fields of the wrong type) is routed
on its path alone and forwarded unchanged: the worker gives the real error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

# Bodies above this are routed without reading them (no model filter, no prefix).
MAX_PARSE_BYTES = 8 * 1024 * 1024
# cache_aware only looks at this much of the prompt.
MAX_PREFIX_CHARS = 16384

# Required capabilities implied by the route alone.
ROUTE_CAPABILITIES: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset({"chat"}),
    "/v1/completions": frozenset({"completion"}),
    "/generate": frozenset({"completion"}),
    "/v1/embeddings": frozenset({"embedding"}),
    "/v1/audio/speech": frozenset({"speech"}),
    "/v1/rerank": frozenset(),
    "/v1/score": frozenset(),
}

_PART_CAPABILITIES = {
    "image_url": "image_input",
    "input_image": "image_input",
    "image": "image_input",
    "input_audio": "audio_input",
    "audio_url": "audio_input",
    "audio": "audio_input",
    "video_url": "video_input",
    "video": "video_input",
}


class _Part(msgspec.Struct):
    type: Any = None
    text: Any = None


class _Message(msgspec.Struct):
    content: str | list[_Part] | None = None


class _Body(msgspec.Struct):
    model: Any = None
    stream: Any = None
    modalities: Any = None
    messages: list[_Message] | None = None
    prompt: Any = None
    text: Any = None
    input_ids: Any = None
    # Raw: presence is all that matters, so base64 media is never decoded.
    image_data: msgspec.Raw = msgspec.Raw()
    audio_data: msgspec.Raw = msgspec.Raw()
    video_data: msgspec.Raw = msgspec.Raw()


_decoder = msgspec.json.Decoder(_Body)


@dataclass(frozen=True, slots=True)
class RouteMeta:
    """Routing facts about one request."""

    model: str | None = None
    is_stream: bool = False
    capabilities: frozenset[str] = frozenset()
    prefix_text: str = ""  # for cache_aware; at most MAX_PREFIX_CHARS characters
    # The prompt's token ids, when cache_aware routes by the workers' KV events.
    token_ids: tuple[int, ...] | None = None


def parse_route_meta(path: str, body: bytes) -> RouteMeta:
    """Read routing facts from a request body sent to `path`."""
    base = ROUTE_CAPABILITIES.get(path, frozenset())
    if not body or len(body) > MAX_PARSE_BYTES:
        return RouteMeta(capabilities=base)
    try:
        parsed = _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        # Not JSON, not UTF-8 (msgspec raises UnicodeDecodeError for invalid bytes
        # inside strings), or nested past msgspec's depth limit: the worker judges it.
        return RouteMeta(capabilities=base)
    caps = set(base)
    is_stream = parsed.stream is True
    if is_stream:
        caps.add("streaming")
    if isinstance(parsed.modalities, list) and "audio" in parsed.modalities:
        caps.add("audio_output")
    for field, cap in (
        (parsed.image_data, "image_input"),
        (parsed.audio_data, "audio_input"),
        (parsed.video_data, "video_input"),
    ):
        if len(field) and bytes(field) != b"null":
            caps.add(cap)
    if parsed.messages:
        caps.update(_message_capabilities(parsed.messages))
    model = parsed.model if isinstance(parsed.model, str) and parsed.model else None
    return RouteMeta(
        model=model,
        is_stream=is_stream,
        capabilities=frozenset(caps),
        prefix_text=_prefix_text(parsed),
    )


def _message_capabilities(messages: list[_Message]) -> set[str]:
    caps: set[str] = set()
    for message in messages:
        if isinstance(message.content, list):
            for part in message.content:
                cap = _PART_CAPABILITIES.get(part.type) if isinstance(part.type, str) else None
                if cap is not None:
                    caps.add(cap)
    return caps


def _prefix_text(parsed: _Body) -> str:
    """The start of the prompt as text: chat contents, prompt, text, or token ids."""
    if parsed.messages:
        pieces: list[str] = []
        size = 0
        for message in parsed.messages:
            for piece in _content_texts(message.content):
                pieces.append(piece)
                size += len(piece) + 1
                if size >= MAX_PREFIX_CHARS:
                    return "\n".join(pieces)[:MAX_PREFIX_CHARS]
        return "\n".join(pieces)
    for value in (parsed.prompt, parsed.text, parsed.input_ids):
        text = _as_text(value)
        if text:
            return text[:MAX_PREFIX_CHARS]
    return ""


def _content_texts(content: str | list[_Part] | None) -> list[str]:
    if isinstance(content, str):
        return [content]
    if content is None:
        return []
    return [part.text for part in content if isinstance(part.text, str)]


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return first  # a batch: route on the first prompt
        if isinstance(first, int):
            return " ".join(str(t) for t in value[: MAX_PREFIX_CHARS // 4])
        if isinstance(first, list):
            return _as_text(first)
    return ""
