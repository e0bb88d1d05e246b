"""OpenAI's Responses API, protocol-free: raw JSON bytes in, a status and a JSON body (or a
stream of server-sent events) out. The HTTP routes in `openai_routes` are thin over it.

A response is generated along the chat completions path: the request's `instructions` and
`input` (plus, with `previous_response_id`, the stored conversation it continues) become
chat messages, rendered with the model's chat template by `OpenAIServing.render_chat`,
then one `EngineClient.generate`:

    result = await responses.create(body)
    if isinstance(result, OpenAIResponse):     # errors, and every non-stream answer
        send(result.status, result.body)
    else:                                       # ResponsesStream: "stream": true, accepted
        async for frame in result.sse(): ...    # `event: <type>\\ndata: <json>\\n\\n` frames

Stored responses (`store`, true by default) live in this process's memory only: at most
MAX_STORED_RESPONSES of them, each for STORED_RESPONSE_TTL_S; the oldest go first. They are
what `retrieve`, `delete` and `previous_response_id` find. `text.format` json_schema and
json_object constrain the answer as chat's `response_format` does. Background responses,
tools and non-text input are refused with a 400 naming the field.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from cadence.errors import InvalidParameter, RequestError
from cadence.front.engine_client import EngineClient
from cadence.front.request_checks import check_message_count
from cadence.io_struct import GenerateReqInput
from cadence.serving import native_api
from cadence.serving import openai_protocol as proto
from cadence.serving.body import parse_body
from cadence.serving.errors import error_body, request_fault
from cadence.serving.openai_serving import OpenAIResponse, OpenAIServing, error_response

logger = logging.getLogger(__name__)

# Stored responses kept in memory at most; beyond it the oldest is dropped.
MAX_STORED_RESPONSES = 1024
# Seconds a stored response can be retrieved or continued after it was stored.
STORED_RESPONSE_TTL_S = 3600.0
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


# -- the store --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was answered
    # The conversation a follow-up continues: what produced this response (without its
    # instructions) and then its output, as chat messages. Shared, never mutated.
    messages: list[dict[str, str]]
    stored_at: float  # the store's clock when stored


class ResponseStore:
    """Stored responses by id, oldest first: at most `max_entries`, each for `ttl_s`.

    Single-threaded (the front's event loop). An entry past its TTL is gone for every reader,
    whether or not a sweep removed it yet."""

    def __init__(
        self,
        max_entries: int = MAX_STORED_RESPONSES,
        ttl_s: float = STORED_RESPONSE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        self._sweep()
        return len(self._entries)

    def put(self, response: dict, messages: list[dict[str, str]]) -> None:
        self._entries[response["id"]] = StoredResponse(response, messages, self.clock())
        self._entries.move_to_end(response["id"])
        self._sweep()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._sweep()
        return self._entries.get(response_id)

    def pop(self, response_id: str) -> StoredResponse | None:
        self._sweep()
        return self._entries.pop(response_id, None)

    def _sweep(self) -> None:
        # Entries are in storing order, so the expired ones are at the front.
        oldest = self.clock() - self.ttl_s
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.stored_at > oldest:
                break
            self._entries.popitem(last=False)


# -- serving ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    """One accepted request: what shaping its results needs."""

    req: ResponsesRequest
    obj: GenerateReqInput
    id: str  # resp_<hex>
    message_id: str  # msg_<hex>: the one output message
    model: str
    history: list[dict[str, str]]  # the conversation, without instructions
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def wants_logprobs(self) -> bool:
        return self.obj.return_logprob


class ResponsesStream:
    """An accepted streaming request: `sse()` yields its server-sent event frames. Leaving
    `sse()` early (or `aclose()`) aborts the request."""

    def __init__(self, events: AsyncIterator[dict]):
        self._events = events

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            async for event in self._events:
                yield (
                    b"event: "
                    + event["type"].encode()
                    + b"\ndata: "
                    + msgspec.json.encode(event)
                    + b"\n\n"
                )
        finally:
            await self._events.aclose()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.sse()

    async def aclose(self) -> None:
        await self._events.aclose()


class ResponsesServing:
    """Serves /v1/responses over the chat path of `OpenAIServing` (same template, same
    model check, same engine client)."""

    def __init__(self, openai: OpenAIServing, store: ResponseStore | None = None):
        self.openai = openai
        self.store = store if store is not None else ResponseStore()

    @property
    def client(self) -> EngineClient:
        return self.openai.client

    # ---- routes ---------------------------------------------------------------------------

    async def create(self, body: bytes | str | dict) -> OpenAIResponse | ResponsesStream:
        try:
            req = parse_request(body)
            self.openai.check_model(req.model)
            job = await self._job(req)
            gen = self.client.generate(job.obj)
            if req.stream:
                # Errors up to the first chunk (admission, prefill) are an ordinary error answer.
                try:
                    first = await gen.__anext__()
                except StopAsyncIteration:
                    first = None
                return ResponsesStream(self._events(job, gen, first))
            result = await native_api.last_result(gen)
            meta = result["meta_info"]
            response = self._finish(job, result["text"], self._logprobs(job, meta), meta)
            return _ok(response)
        except PreviousResponseNotFound as e:
            body = error_body(400, str(e), e.param)
            body["error"]["code"] = "previous_response_not_found"
            return OpenAIResponse(400, msgspec.json.encode(body))
        except (InvalidParameter, RequestError) as e:
            return error_response(e, NAMES)
        except Exception as e:
            logger.exception("Responses request failed")
            return error_response(request_fault("serving the request", e), NAMES)

    def retrieve(self, response_id: str) -> OpenAIResponse:
        stored = self.store.get(response_id)
        return _ok(stored.response) if stored is not None else _not_found(response_id)

    def cancel(self, response_id: str) -> OpenAIResponse:
        """Only background responses can be cancelled, and this server runs none."""
        if self.store.get(response_id) is None:
            return _not_found(response_id)
        return OpenAIResponse(
            400, msgspec.json.encode(error_body(400, "Cannot cancel a synchronous response."))
        )

    def delete(self, response_id: str) -> OpenAIResponse:
        if self.store.pop(response_id) is None:
            return _not_found(response_id)
        return _ok({"id": response_id, "object": "response", "deleted": True})

    # ---- one request ------------------------------------------------------------------------

    async def _job(self, req: ResponsesRequest) -> _Job:
        history: list[dict[str, str]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise PreviousResponseNotFound(req.previous_response_id)
            history += previous.messages
        if isinstance(req.input, list):  # before any item is looked at
            check_message_count("input", len(history) + len(req.input), self.client.info)
        history += input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        input_ids = await self.openai.render_chat(
            system + history, {"add_generation_prompt": True}, "input"
        )
        max_tokens = req.max_output_tokens
        if max_tokens is None:  # OpenAI's default: whatever the context leaves
            max_tokens = max(self.client.info.context_len - len(input_ids), 1)
        sampling = {
            "max_new_tokens": max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "json_schema": json_schema(req),  # checked at the edge like chat's constraint
        }
        rid = uuid.uuid4().hex
        obj = GenerateReqInput(
            input_ids=input_ids,
            sampling_params={k: v for k, v in sampling.items() if v is not None},
            rid=rid,
            return_logprob=req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or ()),
            top_logprobs_num=req.top_logprobs or 0,
            return_text_in_logprobs=True,
            stream=bool(req.stream),
        )
        model = req.model or self.client.info.served_model_name
        return _Job(req, obj, f"resp_{rid}", f"msg_{uuid.uuid4().hex}", model, history)

    def _logprobs(self, job: _Job, meta: dict) -> list[dict]:
        if not job.wants_logprobs:
            return []
        return proto.chat_logprobs(
            meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs")
        )["content"]

    async def _events(
        self, job: _Job, gen: AsyncIterator, first: dict | None
    ) -> AsyncIterator[dict]:
        """The stream's events, numbered from 0; ends the engine request if left early."""
        sequence = itertools.count()

        def event(kind: str, **fields) -> dict:
            return {"type": kind, "sequence_number": next(sequence), **fields}

        where = {"item_id": job.message_id, "output_index": 0, "content_index": 0}
        texts: list[str] = []
        logprobs: list[dict] = []
        meta: dict = first["meta_info"] if first is not None else {}
        deltas = _chain(first, gen)
        failure: Exception | None = None
        try:
            started = self._response(job, "in_progress")
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            item = {**self._message(job, "", [], "in_progress"), "content": []}
            yield event("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": []}
            yield event("response.content_part.added", **where, part=part)
            async for delta in deltas:
                meta = delta["meta_info"]
                piece, piece_logprobs = delta["text"], self._logprobs(job, meta)
                if piece or piece_logprobs:
                    texts.append(piece)
                    logprobs += piece_logprobs
                    yield event(
                        "response.output_text.delta", **where, delta=piece, logprobs=piece_logprobs
                    )
        except (InvalidParameter, RequestError) as e:
            failure = e
        except Exception as e:
            logger.exception("Responses stream failed")
            failure = request_fault("streaming the response", e)
        finally:
            await deltas.aclose()
            await gen.aclose()
        text = "".join(texts)
        response = None
        if failure is None:
            try:
                response = self._finish(job, text, logprobs, meta)
            except Exception as e:  # the stream still ends with a terminal event
                logger.exception("Responses stream failed")
                failure = request_fault("finishing the response", e)
        if response is None:
            async for failed in self._failure(job, event, text, logprobs, meta, failure):
                yield failed
            return
        message = response["output"][0]
        yield event("response.output_text.done", **where, text=text, logprobs=logprobs)
        yield event("response.content_part.done", **where, part=message["content"][0])
        yield event("response.output_item.done", output_index=0, item=message)
        # Every finished generation ends with response.completed, as SGLang's streams do; its
        # Response says whether the answer is whole (status, incomplete_details). The SDK's
        # stream helper (get_final_response) and SGLang's clients wait for this event alone.
        yield event("response.completed", response=response)

    async def _failure(
        self,
        job: _Job,
        event: Callable[..., dict],
        text: str,
        logprobs: list,
        meta: dict,
        e: Exception,
    ) -> AsyncIterator[dict]:
        """What a stream that failed midway ends with: an error event, then response.failed
        (with what was generated so far)."""
        status = getattr(e, "status", 500)
        code = "server_error" if status >= 500 else FAILURE_CODES.get(status, "invalid_prompt")
        yield event("error", code=code, message=str(e), param=getattr(e, "param", None))
        error = {"code": code, "message": str(e)}
        yield event(
            "response.failed", response=self._finish(job, text, logprobs, meta, error=error)
        )

    # ---- results → Response objects -----------------------------------------------------------

    def _finish(
        self, job: _Job, text: str, logprobs: list, meta: dict, error: dict | None = None
    ) -> dict:
        """The finished Response (completed, incomplete or failed), stored unless the
        request said `store: false`."""
        reason = (meta.get("finish_reason") or {}).get("type")
        incomplete = None
        if error is not None:
            status = "failed"
        elif reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif reason == "abort":  # ended early by the server (its deadline, /abort_request)
            status = "incomplete"
        else:
            status = "completed"
        message = self._message(
            job, text, logprobs, "completed" if status == "completed" else "incomplete"
        )
        response = self._response(
            job, status, [message], _usage(meta), error=error, incomplete=incomplete
        )
        if job.req.store is not False:
            self.store.put(response, [*job.history, {"role": "assistant", "content": text}])
        return response

    @staticmethod
    def _message(job: _Job, text: str, logprobs: list, status: str) -> dict:
        return {
            "id": job.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [
                {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            ],
        }

    @staticmethod
    def _response(
        job: _Job,
        status: str,
        output: list | None = None,
        usage: dict | None = None,
        error: dict | None = None,
        incomplete: dict | None = None,
    ) -> dict:
        req = job.req
        return {
            "id": job.id,
            "object": "response",
            "created_at": job.created_at,
            "status": status,
            "model": job.model,
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


# -- helpers ----------------------------------------------------------------------------------


async def _chain(first: dict | None, rest: AsyncIterator) -> AsyncIterator[dict]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


def _usage(meta: dict) -> dict:
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


def _ok(obj: dict) -> OpenAIResponse:
    return OpenAIResponse(200, msgspec.json.encode(obj))


def _not_found(response_id: str) -> OpenAIResponse:
    message = f"Response with id '{response_id}' not found."
    return OpenAIResponse(404, msgspec.json.encode(error_body(404, message)))
