"""OpenAI's Responses API, the protocol: the request body (`ResponsesRequest`), its checks,
its `input` as chat messages, and the shapes of what is answered (a Response object, its
output message, its usage). Protocol-free serving is `serving.responses`.

Everything a body can get wrong is an `InvalidParameter` naming the field at fault; errors
raised below (by the engine client) name native fields, which `NAMES` maps back to the
Responses fields the client sent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from cadence.errors import InvalidParameter
from cadence.serving import openai_protocol as proto
from cadence.serving.body import parse_body

MAX_METADATA_PAIRS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")  # output_text: a replayed assistant output item
LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_FORMATS = ("text", "json_object", "json_schema")
# The fields of a text.format the Response echoes (OpenAI's ResponseFormatTextConfig).
_FORMAT_FIELDS = ("type", "name", "schema", "description", "strict")
# HTTP status -> the `code` of a response that failed midway (any 5xx: server_error).
FAILURE_CODES = {429: "rate_limit_exceeded"}

# Native field -> the Responses field it came from, for errors raised below us.
NAMES = {
    "max_new_tokens": "max_output_tokens",
    "text": "input",
    "input_ids": "input",
    "top_logprobs_num": "top_logprobs",
    "json_schema": "text.format",
}


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The body of POST /v1/responses. None everywhere means "not given"; other fields of
    OpenAI's API (reasoning, truncation, user, service_tier, ...) are accepted and ignored."""

    input: str | list[Any]  # a string (one user turn) or a list of messages
    model: str | None = None  # the served model name; None means the served model
    instructions: str | None = None  # a system message first; not carried to follow-ups
    previous_response_id: str | None = None  # continue that stored response's conversation
    max_output_tokens: int | None = None  # default: whatever the context leaves
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None  # alternatives per output token; turns logprobs on
    include: list[str] | None = None  # "message.output_text.logprobs" turns logprobs on
    stream: bool | None = None
    store: bool | None = None  # default true: retrievable and continuable
    metadata: dict[str, str] | None = None  # echoed back; at most 16 pairs
    background: bool | None = None  # refused when true
    tools: list[Any] | None = None  # refused unless empty: no tool calling yet
    tool_choice: str | dict[str, Any] | None = None  # only "none" / "auto"
    parallel_tool_calls: bool | None = None  # echoed, not used
    # {"format": {"type": "text"}}, {"format": {"type": "json_object"}} or {"format":
    # {"type": "json_schema", "name", "schema", "strict"}}: the last two constrain the answer
    text: dict[str, Any] | None = None
    conversation: Any = None  # refused: no Conversations API
    prompt: Any = None  # refused: no stored prompt templates


class PreviousResponseNotFound(InvalidParameter):
    def __init__(self, response_id: str):
        super().__init__(
            "previous_response_id", f"Previous response with id '{response_id}' not found."
        )


# -- parsing ----------------------------------------------------------------------------------


def parse_request(body: bytes | str | dict) -> ResponsesRequest:
    """Decode and check a request body; `InvalidParameter` names the field at fault."""
    req = parse_body(
        ResponsesRequest, body, {"input": "input is required: a string or a list of messages"}
    )
    _check(req)
    return req


def _check(req: ResponsesRequest) -> None:
    if req.temperature is not None and not 0 <= req.temperature <= proto.MAX_TEMPERATURE:
        raise InvalidParameter(
            "temperature",
            f"temperature must be in [0, {proto.MAX_TEMPERATURE:g}] (0 means greedy), "
            f"got {req.temperature:g}",
        )
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidParameter(
            "max_output_tokens", f"max_output_tokens must be >= 1, got {req.max_output_tokens}"
        )
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= proto.MAX_TOP_LOGPROBS:
        raise InvalidParameter(
            "top_logprobs",
            f"top_logprobs must be in [0, {proto.MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
        )
    if req.background:
        raise InvalidParameter(
            "background", "background: background responses are not supported; remove it"
        )
    if req.tools:
        raise InvalidParameter(
            "tools", "tools: tool calling is not supported by this server yet; remove tools"
        )
    if req.tool_choice not in (None, "none", "auto"):
        raise InvalidParameter(
            "tool_choice", "tool_choice: tool calling is not supported by this server yet"
        )
    _check_text(req.text)
    _check_metadata(req.metadata)
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise InvalidParameter(
                name,
                f"{name}: not supported by this server; send the conversation as input "
                "or continue it with previous_response_id",
            )


def _check_text(text: dict[str, Any] | None) -> None:
    """text.format as OpenAI defines it. Errors name `text.format`, not `text` (that would
    read as the native prompt field)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in TEXT_FORMATS:
        raise InvalidParameter(
            "text.format",
            f"text.format.type must be one of {', '.join(TEXT_FORMATS)}, got {kind!r}",
        )
    if kind != "json_schema":
        return
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidParameter("text.format", "text.format.schema must be a JSON schema object")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise InvalidParameter("text.format", "text.format.name must be a non-empty string")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise InvalidParameter("text.format", "text.format.strict must be true or false")


def text_format(req: ResponsesRequest) -> dict[str, Any]:
    """The request's text.format as the Response echoes it (text when none was given)."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {k: v for k, v in fmt.items() if k in _FORMAT_FIELDS}


def json_schema(req: ResponsesRequest) -> str | None:
    """The JSON schema text.format puts on the answer (chat's response_format constraint)."""
    fmt = text_format(req)
    if fmt["type"] == "json_object":
        return '{"type":"object"}'
    if fmt["type"] == "json_schema":
        return msgspec.json.encode(fmt["schema"]).decode()
    return None


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidParameter(
            "metadata", f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidParameter(
                "metadata",
                f"metadata[{key[:20]!r}]: keys are at most {MAX_METADATA_KEY_CHARS} "
                f"characters, values at most {MAX_METADATA_VALUE_CHARS}",
            )


def input_messages(value: str | list[Any]) -> list[dict[str, str]]:
    """The request's `input` as chat messages ({role, content: str}); developer becomes system."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidParameter("input", "input must be a string or a non-empty list of messages")
    return [_input_message(i, item) for i, item in enumerate(value)]


def _input_message(i: int, item: Any) -> dict[str, str]:
    if not isinstance(item, dict):
        raise InvalidParameter("input", f"input[{i}] must be a message: {{role, content}}")
    kind = item.get("type", "message")
    if kind == "item_reference":
        raise InvalidParameter(
            "input",
            f"input[{i}]: item_reference is not supported; send the item itself "
            "or continue with previous_response_id",
        )
    if kind != "message":
        raise InvalidParameter(
            "input",
            f"input[{i}]: {kind!r} items are not supported (no tool calling or reasoning "
            "items yet); send messages only",
        )
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise InvalidParameter(
            "input", f"input[{i}].role must be one of {', '.join(INPUT_ROLES)}, got {role!r}"
        )
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_part_text(i, j, part) for j, part in enumerate(content))
    else:
        raise InvalidParameter(
            "input", f"input[{i}].content must be a string or a list of input_text parts"
        )
    return {"role": "system" if role == "developer" else role, "content": text}


def _part_text(i: int, j: int, part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind in ("input_image", "input_file", "input_audio"):
        raise InvalidParameter(
            "input", f"input[{i}].content[{j}]: this model does not accept {kind} input"
        )
    raise InvalidParameter(
        "input",
        f'input[{i}].content[{j}] must be a text part ({{"type": "input_text", "text": ...}})',
    )


# -- what is answered ------------------------------------------------------------------------


def message_item(message_id: str, text: str, logprobs: list, status: str) -> dict:
    """The Response's one output message."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}],
    }


@dataclasses.dataclass(frozen=True)
class ResponseHead:
    """What a Response says of itself beside the request it answers."""

    id: str  # resp_<hex>
    created_at: int
    model: str


def response_object(
    req: ResponsesRequest,
    head: ResponseHead,
    status: str,
    output: list | None = None,
    usage: dict | None = None,
    error: dict | None = None,
    incomplete: dict | None = None,
) -> dict:
    """A Response object (in progress or finished); its settings echo `req`."""
    return {
        "id": head.id,
        "object": "response",
        "created_at": head.created_at,
        "status": status,
        "model": head.model,
        "output": output or [],
        "usage": usage,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_logprobs": req.top_logprobs,
        "tool_choice": req.tool_choice or "auto",
        "tools": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": text_format(req)},
        "truncation": "disabled",
        "previous_response_id": req.previous_response_id,
        "metadata": req.metadata or {},
        "store": req.store is not False,
        "background": False,
    }


def finish_status(meta: dict, error: dict | None) -> tuple[str, dict | None]:
    """A finished Response's status (completed, incomplete or failed) and, when the answer
    was cut at max_output_tokens, its incomplete_details."""
    reason = (meta.get("finish_reason") or {}).get("type")
    if error is not None:
        return "failed", None
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == "abort":  # ended early by the server (its deadline, /abort_request)
        return "incomplete", None
    return "completed", None


def usage(meta: dict) -> dict:
    num_input = meta.get("prompt_tokens", 0)
    num_output = meta.get("completion_tokens", 0)
    return {
        "input_tokens": num_input,
        "input_tokens_details": {
            "cached_tokens": meta.get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input + num_output,
    }
