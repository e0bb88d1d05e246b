"""OpenAI's Responses API, protocol-free: raw JSON bytes in, a status and a JSON body (or a
stream of server-sent events) out. The HTTP routes in `openai_routes` are thin over it;
the request's checks and the shapes of a Response are `responses_protocol`.

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

import msgspec

from cadence.errors import InvalidParameter, RequestError
from cadence.front.engine_client import EngineClient
from cadence.front.request_checks import check_message_count
from cadence.io_struct import GenerateReqInput
from cadence.serving import native_api
from cadence.serving import openai_protocol as proto
from cadence.serving import responses_protocol as rp
from cadence.serving.errors import error_body, request_fault
from cadence.serving.openai_results import OpenAIResponse, error_response
from cadence.serving.openai_serving import OpenAIServing
from cadence.serving.responses_protocol import ResponsesRequest

logger = logging.getLogger(__name__)

# Stored responses kept in memory at most; beyond it the oldest is dropped.
MAX_STORED_RESPONSES = 1024
# Seconds a stored response can be retrieved or continued after it was stored.
STORED_RESPONSE_TTL_S = 3600.0


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
    head: rp.ResponseHead  # its id (resp_<hex>), created_at and model
    message_id: str  # msg_<hex>: the one output message
    history: list[dict[str, str]]  # the conversation, without instructions

    @property
    def wants_logprobs(self) -> bool:
        return self.obj.return_logprob


class _StreamEvents:
    """The events of one streamed Response, numbered from 0, and what it said so far."""

    def __init__(self, job: _Job, first: dict | None):
        self.job = job
        self.sequence = itertools.count()
        self.where = {"item_id": job.message_id, "output_index": 0, "content_index": 0}
        self.texts: list[str] = []
        self.logprobs: list[dict] = []
        self.meta: dict = first["meta_info"] if first is not None else {}

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def event(self, kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(self.sequence), **fields}

    def opening(self) -> list[dict]:
        job = self.job
        started = rp.response_object(job.req, job.head, "in_progress")
        item = {**rp.message_item(job.message_id, "", [], "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self.event("response.created", response=started),
            self.event("response.in_progress", response=started),
            self.event("response.output_item.added", output_index=0, item=item),
            self.event("response.content_part.added", **self.where, part=part),
        ]

    def delta(self, delta: dict, logprobs: list[dict]) -> dict | None:
        """A delta's output_text.delta event (None when it says nothing)."""
        self.meta = delta["meta_info"]
        piece = delta["text"]
        if not (piece or logprobs):
            return None
        self.texts.append(piece)
        self.logprobs += logprobs
        return self.event(
            "response.output_text.delta", **self.where, delta=piece, logprobs=logprobs
        )

    def closing(self, response: dict) -> list[dict]:
        message = response["output"][0]
        where, text = self.where, self.text
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=self.logprobs),
            self.event("response.content_part.done", **where, part=message["content"][0]),
            self.event("response.output_item.done", output_index=0, item=message),
            # Every finished generation ends with response.completed, as SGLang's streams do;
            # its Response says whether the answer is whole (status, incomplete_details). The
            # SDK's stream helper (get_final_response) and SGLang's clients wait for it alone.
            self.event("response.completed", response=response),
        ]


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
            req = rp.parse_request(body)
            lora_path = await self.openai.resolve_model(req.model)
            job = await self._job(req, lora_path)
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
        except rp.PreviousResponseNotFound as e:
            body = error_body(400, str(e), e.param)
            body["error"]["code"] = "previous_response_not_found"
            return OpenAIResponse(400, msgspec.json.encode(body))
        except (InvalidParameter, RequestError) as e:
            return error_response(e, rp.NAMES)
        except Exception as e:
            logger.exception("Responses request failed")
            return error_response(request_fault("serving the request", e), rp.NAMES)

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

    async def _job(self, req: ResponsesRequest, lora_path: str | None = None) -> _Job:
        history: list[dict[str, str]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise rp.PreviousResponseNotFound(req.previous_response_id)
            history += previous.messages
        if isinstance(req.input, list):  # before any item is looked at
            check_message_count("input", len(history) + len(req.input), self.client.info)
        history += rp.input_messages(req.input)
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
            "json_schema": rp.json_schema(req),  # checked at the edge like chat's constraint
        }
        rid = uuid.uuid4().hex
        obj = GenerateReqInput(
            input_ids=input_ids,
            sampling_params={k: v for k, v in sampling.items() if v is not None},
            rid=rid,
            return_logprob=req.top_logprobs is not None
            or rp.LOGPROBS_INCLUDE in (req.include or ()),
            top_logprobs_num=req.top_logprobs or 0,
            return_text_in_logprobs=True,
            stream=bool(req.stream),
            lora_path=lora_path,  # the adapter `model` names, if any
        )
        model = req.model or self.client.info.served_model_name
        head = rp.ResponseHead(f"resp_{rid}", int(time.time()), model)
        return _Job(req, obj, head, f"msg_{uuid.uuid4().hex}", history)

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
        events = _StreamEvents(job, first)
        deltas = _chain(first, gen)
        failure: Exception | None = None
        try:
            for event in events.opening():
                yield event
            async for delta in deltas:
                event = events.delta(delta, self._logprobs(job, delta["meta_info"]))
                if event is not None:
                    yield event
        except (InvalidParameter, RequestError) as e:
            failure = e
        except Exception as e:
            logger.exception("Responses stream failed")
            failure = request_fault("streaming the response", e)
        finally:
            await deltas.aclose()
            await gen.aclose()
        for event in self._ending(events, failure):
            yield event

    def _ending(self, events: _StreamEvents, failure: Exception | None) -> list[dict]:
        """The terminal events: the finished Response's, or (failed midway) an error event
        then response.failed with what was generated so far."""
        if failure is None:
            try:
                response = self._finish(events.job, events.text, events.logprobs, events.meta)
                return events.closing(response)
            except Exception as e:  # the stream still ends with a terminal event
                logger.exception("Responses stream failed")
                failure = request_fault("finishing the response", e)
        status = getattr(failure, "status", 500)
        code = "server_error" if status >= 500 else rp.FAILURE_CODES.get(status, "invalid_prompt")
        error = {"code": code, "message": str(failure)}
        failed = self._finish(events.job, events.text, events.logprobs, events.meta, error=error)
        return [
            events.event(
                "error", code=code, message=str(failure), param=getattr(failure, "param", None)
            ),
            events.event("response.failed", response=failed),
        ]

    # ---- results → Response objects -----------------------------------------------------------

    def _finish(
        self, job: _Job, text: str, logprobs: list, meta: dict, error: dict | None = None
    ) -> dict:
        """The finished Response (completed, incomplete or failed), stored unless the
        request said `store: false`."""
        status, incomplete = rp.finish_status(meta, error)
        item_status = "completed" if status == "completed" else "incomplete"
        message = rp.message_item(job.message_id, text, logprobs, item_status)
        response = rp.response_object(
            job.req, job.head, status, [message], rp.usage(meta), error=error, incomplete=incomplete
        )
        if job.req.store is not False:
            self.store.put(response, [*job.history, {"role": "assistant", "content": text}])
        return response


# -- helpers ----------------------------------------------------------------------------------


async def _chain(first: dict | None, rest: AsyncIterator) -> AsyncIterator[dict]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


def _ok(obj: dict) -> OpenAIResponse:
    return OpenAIResponse(200, msgspec.json.encode(obj))


def _not_found(response_id: str) -> OpenAIResponse:
    message = f"Response with id '{response_id}' not found."
    return OpenAIResponse(404, msgspec.json.encode(error_body(404, message)))
