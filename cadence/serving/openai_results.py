"""What the OpenAI-compatible API answers: the result types of `OpenAIServing`, and the
engine's results turned into OpenAI's shapes (a completion's choices and usage, the chunks
of a stream, an error body naming the request's own fields).

`OpenAIServing` (openai_serving.py) turns a request into a `Job` and runs it; this module
turns what the job produced into bytes, so both adapters (HTTP routes, gRPC pass-through)
send the same answer.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from cadence.errors import InvalidParameter, RequestError
from cadence.io_struct import GenerateReqInput
from cadence.serving import openai_protocol as proto
from cadence.serving.chat_answer import ChatAnswer, ChatAnswerStream
from cadence.serving.errors import error_body

# -- the result types -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpenAIResponse:
    """A whole answer: the HTTP status and the JSON body (an error body when status >= 400)."""

    status: int
    body: bytes
    is_request_fault: bool = False  # a 5xx caused by the request itself (see serving.errors)


class StreamFailed(Exception):
    """A stream ended by an error after it had started; `body` is the JSON error body."""

    def __init__(self, status: int, body: bytes, is_request_fault: bool = False):
        super().__init__(body.decode())
        self.status = status
        self.body = body
        self.is_request_fault = is_request_fault


class OpenAIStream:
    """An accepted streaming request. Iterate for the JSON bytes of each chunk (no `data: `,
    no `[DONE]`); the iteration raises `StreamFailed` if the request fails midway.
    `aclose()` (or leaving `sse()` early) aborts the request."""

    def __init__(self, chunks: AsyncIterator[dict]):
        self._chunks = chunks

    def __aiter__(self):
        return self._encoded()

    async def _encoded(self):
        try:
            async for chunk in self._chunks:
                yield msgspec.json.encode(chunk)
        except (InvalidParameter, RequestError) as e:
            raise StreamFailed(*error_parts(e)) from None
        finally:
            await self._chunks.aclose()

    async def sse(self) -> AsyncIterator[bytes]:
        """Server-sent event frames: one per chunk, an error event on failure, then [DONE]."""
        chunks = self.__aiter__()
        try:
            async for chunk in chunks:
                yield b"data: " + chunk + b"\n\n"
        except StreamFailed as e:
            yield b"data: " + e.body + b"\n\n"
        finally:
            await chunks.aclose()
        yield b"data: [DONE]\n\n"

    async def aclose(self) -> None:
        await self._chunks.aclose()


OpenAIResult = OpenAIResponse | OpenAIStream


def ok(obj: dict) -> OpenAIResponse:
    return OpenAIResponse(200, msgspec.json.encode(obj))


def error_response(e: Exception, names: dict[str, str] | None = None) -> OpenAIResponse:
    """The OpenAI error answer for an InvalidParameter or RequestError; `names` maps native
    field names to the request's own (see `error_parts`)."""
    return OpenAIResponse(*error_parts(e, names))


def error_parts(e: Exception, names: dict[str, str] | None = None) -> tuple[int, bytes, bool]:
    """(status, JSON error body, is_request_fault) for an InvalidParameter or RequestError,
    with native field names (max_new_tokens, ...) renamed to the OpenAI fields the client sent."""
    status = getattr(e, "status", 400)
    param, message = getattr(e, "param", None), str(e)
    if names:
        if param in names:
            param = names[param]
        for native, name in names.items():
            # Only whole-word names; text/input_ids only where they name the field at fault.
            pattern = rf"\b{native}\b" if "_" in native else rf"^{native}(?=[:\[ ])"
            message = re.sub(pattern, name, message)
    return (
        status,
        msgspec.json.encode(error_body(status, message, param)),
        getattr(e, "is_request_fault", False),
    )


# -- one accepted request ----------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """One accepted request: what shaping its results needs."""

    req: Any  # ChatCompletionRequest | CompletionRequest
    obj: GenerateReqInput
    id: str
    model: str
    names: dict[str, str]  # native field -> OpenAI field, for errors raised below us
    num_choices: int
    prompt_texts: list[str] = dataclasses.field(default_factory=list)  # per prompt, for echo
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    answer: ChatAnswer | None = None  # chat: how its text becomes the assistant message

    @property
    def is_chat(self) -> bool:
        return isinstance(self.req, proto.ChatCompletionRequest)

    @property
    def n(self) -> int:
        return self.req.n or 1

    def echo_text(self, index: int) -> str:
        return self.prompt_texts[index // self.n] if getattr(self.req, "echo", False) else ""

    def chat_logprobs(self, meta: dict) -> dict | None:
        if not self.req.logprobs:
            return None
        return proto.chat_logprobs(
            meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs")
        )

    def completion_logprobs(self, meta: dict, offset: int, with_prompt: bool) -> dict | None:
        req = self.req
        if req.logprobs is None:
            return None
        tokens, tops = [], []
        if with_prompt and req.echo:
            tokens += meta.get("input_token_logprobs") or []
            tops += meta.get("input_top_logprobs") or []
            tops += [None] * (len(tokens) - len(tops))
        tokens += meta.get("output_token_logprobs") or []
        tops += meta.get("output_top_logprobs") or []
        return proto.completion_logprobs(tokens, tops, req.logprobs, offset)


# -- a whole answer ----------------------------------------------------------------------------


def response_body(job: Job, results: list[dict]) -> dict:
    """The chat.completion or text_completion of a job's final results (one per choice)."""
    choices = [_choice(job, i, r) for i, r in enumerate(results)]
    firsts = results[:: job.n]  # one sample per prompt: the prompt counts once
    usage = proto.usage(
        sum(r["meta_info"]["prompt_tokens"] for r in firsts),
        sum(r["meta_info"]["completion_tokens"] for r in results),
        sum(r["meta_info"].get("cached_tokens", 0) for r in firsts),
    )
    kind = "chat.completion" if job.is_chat else "text_completion"
    return {
        "id": job.id,
        "object": kind,
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage,
    }


def _choice(job: Job, index: int, result: dict) -> dict:
    meta = result["meta_info"]
    reason = meta.get("finish_reason")
    choice: dict[str, Any] = {"index": index}
    finish_reason = proto.finish_reason(reason)
    if job.is_chat:
        choice["message"], finish_reason = job.answer.message(result["text"], finish_reason)
        choice["logprobs"] = job.chat_logprobs(meta)
    else:
        choice["text"] = job.echo_text(index) + result["text"]
        choice["logprobs"] = job.completion_logprobs(meta, 0, with_prompt=True)
    choice["finish_reason"] = finish_reason
    choice["matched_stop"] = proto.matched_stop(reason)
    hidden = meta.get("hidden_states")
    if job.req.return_hidden_states and hidden:
        # As SGLang: the last position's hidden state (the prompt block's last row when
        # nothing was decoded after the first token).
        last = hidden[-1]
        choice["hidden_states"] = last[-1] if last and isinstance(last[0], list) else last
    return choice


# -- a stream ------------------------------------------------------------------------------------


async def stream_chunks(job: Job, gen: AsyncIterator, first: dict | None) -> AsyncIterator[dict]:
    """The chunks of a stream, `first` (the engine's first delta, already awaited) then the
    rest of `gen`; ends the engine request if left early."""
    chunks = _Chunks(job)
    try:
        if job.is_chat:
            for chunk in chunks.roles(first):
                yield chunk
        pending = [first] if first is not None else []
        while True:
            if pending:
                delta = pending.pop()
            else:
                try:
                    delta = await gen.__anext__()
                except StopAsyncIteration:
                    break
            for chunk in chunks.of_delta(delta):
                yield chunk
        if job.req.include_usage:
            yield chunks.usage()
    finally:
        await gen.aclose()


class _Chunks:
    """The chunks of one stream, and what it has said so far per choice."""

    def __init__(self, job: Job):
        self.job = job
        self.kind = "chat.completion.chunk" if job.is_chat else "text_completion"
        self.metas: dict[int, dict] = {}  # choice index -> its latest meta (counts are cumulative)
        self.offsets: dict[int, int] = {}  # choice index -> chars of text sent (logprob offsets)
        self.answers: dict[int, ChatAnswerStream] = {}  # chat: choice index -> its answer so far

    def chunk(self, choices: list, usage: dict | None = None) -> dict:
        job = self.job
        out = {
            "id": job.id,
            "object": self.kind,
            "created": job.created,
            "model": job.model,
            "choices": choices,
        }
        if job.req.include_usage:
            out["usage"] = usage
        return out

    def roles(self, first: dict | None) -> list[dict]:
        """Chat: each choice's first chunk, the assistant's role with empty content."""
        # Nothing is generated yet: the usage so far is the prompt's alone.
        start = dict(first["meta_info"], completion_tokens=0) if first else None
        usage = continuous_usage(self.job, start)
        delta = {"role": "assistant", "content": "", "reasoning_content": None}
        return [
            self.chunk(
                [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], usage
            )
            for i in range(self.job.num_choices)
        ]

    def of_delta(self, delta: dict) -> list[dict]:
        index = delta.get("index", 0)
        self.metas[index] = delta["meta_info"]
        usage = continuous_usage(self.job, delta["meta_info"])
        if self.job.is_chat:
            choice = self._chat_choice(index, delta)
        else:
            choice = self._completion_choice(index, delta)
        return [] if choice is None else [self.chunk([choice], usage)]

    def usage(self) -> dict:
        """The last chunk of include_usage: no choices, the whole request's usage."""
        metas = [self.metas[i] for i in sorted(self.metas)]
        firsts = metas[:: self.job.n]
        usage = proto.usage(
            sum(m["prompt_tokens"] for m in firsts),
            sum(m["completion_tokens"] for m in metas),
            sum(m.get("cached_tokens", 0) for m in firsts),
        )
        return self.chunk([], usage)

    def _chat_choice(self, index: int, delta: dict) -> dict | None:
        """A chat delta as its choice (None: nothing to say yet): its content,
        reasoning_content and tool_calls. The last one carries the finish_reason together
        with the last text, as vLLM and OpenAI send it; its delta always has a `content`
        string ("" when nothing is left to say) and SGLang's null fields, so clients
        reading `delta.content` of every chunk, and typed clients, work."""
        job, meta = self.job, delta["meta_info"]
        reason = meta.get("finish_reason")
        text = delta["text"]
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        answer = self.answers.get(index)
        if answer is None:
            answer = self.answers[index] = job.answer.stream()
        fields = answer.update(text, is_final=reason is not None)
        logprobs = job.chat_logprobs(meta)
        if reason is None and not (fields or (logprobs and logprobs["content"])):
            return None
        fields.setdefault("reasoning_content", None)
        finish = proto.finish_reason(reason)
        if reason is not None:
            fields.setdefault("content", "")
            fields.setdefault("tool_calls", None)
            if finish == "stop" and answer.has_tool_calls:
                finish = "tool_calls"
        return {
            "index": index,
            "delta": fields,
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": proto.matched_stop(reason),
        }

    def _completion_choice(self, index: int, delta: dict) -> dict | None:
        """A completions delta as its choice (None: nothing to say yet)."""
        job, meta = self.job, delta["meta_info"]
        reason = meta.get("finish_reason")
        text = delta["text"]
        is_first = index not in self.offsets
        if is_first:
            text = job.echo_text(index) + text
        offset = self.offsets.get(index, 0)
        logprobs = job.completion_logprobs(meta, offset, with_prompt=is_first)
        if not text and reason is None and not (logprobs and logprobs["tokens"]):
            return None
        self.offsets[index] = offset + len(text)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": proto.finish_reason(reason),
            "matched_stop": proto.matched_stop(reason),
        }


def continuous_usage(job: Job, meta: dict | None) -> dict | None:
    """stream_options {include_usage, continuous_usage_stats}: the usage so far of the
    chunk's choice on every chunk, as vLLM sends it (continuous_usage_stats alone adds
    nothing: usage is only sent when include_usage asks for it)."""
    options = job.req.stream_options
    if not (meta and job.req.include_usage and options.continuous_usage_stats):
        return None
    return proto.usage(
        meta["prompt_tokens"], meta["completion_tokens"], meta.get("cached_tokens", 0)
    )
