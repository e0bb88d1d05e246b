"""The OpenAI-compatible API as one protocol-free module: raw JSON bytes in, a status and
a JSON body (or a stream of JSON chunks) out.

The HTTP routes (`openai_routes`) and the gRPC pass-through RPCs both call
`OpenAIServing`, so a request gets the same answer whichever way it came:

    result = await serving.chat_completions(body)      # or .completions(body)
    if isinstance(result, OpenAIResponse):              # errors, and every non-stream answer
        send(result.status, result.body)
    else:                                               # OpenAIStream: "stream": true, accepted
        async for chunk in result: ...                  # JSON bytes of one SSE event each;
                                                        # raises StreamFailed mid-stream
        # or, for HTTP: async for frame in result.sse(): ... (`data: ...`, error event, [DONE])

Errors found before a stream starts (bad input, unknown model, overload) are always an
`OpenAIResponse` with the error status, never a stream. Leaving a stream early, or
cancelling a call, aborts the request in the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from cadence.errors import InvalidParameter, RequestError
from cadence.front.engine_client import EngineClient
from cadence.front.request_checks import (
    check_message_count,
    check_prompt_chars,
    require_generation_model,
)
from cadence.io_struct import GenerateReqInput
from cadence.parsers import reasoning_parser
from cadence.parsers.tool_calls import Llama3Parser
from cadence.serving import chat_tools, native_api, speech_chat
from cadence.serving import openai_protocol as proto
from cadence.serving.chat_answer import ChatAnswer, ChatAnswerStream
from cadence.serving.errors import error_body, request_fault
from cadence.serving.speech_serving import server_capabilities

logger = logging.getLogger(__name__)


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
            raise StreamFailed(*_error(e)) from None
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


@dataclasses.dataclass
class _Job:
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


class OpenAIServing:
    """Serves the OpenAI API over the front process's TokenizerManager.

    `state` is anything with `.args` (ServerArgs) and `.client` (the EngineClient, read per
    request: it exists only once the model is loaded). The --chat-template file,
    when given, is read here, so a bad one stops the server at start-up.
    """

    def __init__(self, state):
        self.state = state
        self.chat_template = None
        path = getattr(state.args, "chat_template", None)
        if path:
            self.chat_template = _read_chat_template(path)
        self.tool_call_parser = getattr(state.args, "tool_call_parser", None)
        self.reasoning_parser = getattr(state.args, "reasoning_parser", None)

    @property
    def client(self) -> EngineClient:
        return self.state.client

    # ---- routes ---------------------------------------------------------------------------

    def list_models(self) -> OpenAIResponse:
        names = self.client.info.served_model_names or (self.client.info.served_model_name,)
        return _ok({"object": "list", "data": [self._model_card(name) for name in names]})

    def retrieve_model(self, model_id: str) -> OpenAIResponse:
        """A served name's card; any other name is 404 (a model list is a contract, even when
        requests naming other models are served)."""
        if model_id not in self._served_names():
            error = RequestError(
                404,
                f"The model {model_id!r} does not exist; this server serves "
                f"{', '.join(map(repr, self._served_names()))}",
                "model",
            )
            return OpenAIResponse(*_error(error))
        return _ok(self._model_card(model_id))

    async def chat_completions(self, body: bytes) -> OpenAIResult:
        if speech_chat.wants_audio(body):  # modalities ["text", "audio"]: docs/speech.md
            try:
                answer = await speech_chat.chat_with_audio(self, body)
            except (InvalidParameter, RequestError) as e:
                return OpenAIResponse(*_error(e))
            return _ok(answer) if isinstance(answer, dict) else OpenAIStream(answer)
        return await self._serve(body, proto.ChatCompletionRequest)

    async def completions(self, body: bytes) -> OpenAIResult:
        return await self._serve(body, proto.CompletionRequest)

    # ---- shared with the other OpenAI APIs (serving.responses) -----------------------------

    def check_model(self, model: str | None) -> None:
        """Raises the 404 RequestError (param `model`) if this server refuses the name."""
        self._check_model(model)

    async def render_chat(
        self,
        messages: list[dict],
        template_options: dict[str, Any],
        prompt_field: str,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The prompt's token ids: `messages` (content as strings) rendered with the chat
        template (--chat-template, else the model's own), with `tools` when given. Errors
        name `prompt_field`."""
        if tools is not None:
            template_options = {**template_options, "tools": tools}
        # The rendered prompt holds every message's text: one that cannot fit the context is
        # refused before the template runs (a long chat renders on a worker thread).
        num_chars = sum(len(m.get("content") or "") for m in messages)
        check_prompt_chars(prompt_field, num_chars, self.client.info, self.client.tokenizer)
        try:
            prompt = await self.client.tokenizer.render_chat_async(
                messages, chat_template=self.chat_template, **template_options
            )
        except Exception as e:  # a template's raise_exception, or a malformed conversation
            raise InvalidParameter(
                prompt_field, f"the chat template rejected the {prompt_field}: {e}"
            ) from None
        # The template writes the special tokens itself.
        return await self.client.tokenize(
            prompt, add_special_tokens=False, prompt_field=prompt_field
        )

    # ---- one request --------------------------------------------------------------------

    async def _serve(self, body: bytes, cls: type) -> OpenAIResult:
        names: dict[str, str] = {}
        try:
            req = proto.parse_request(cls, body)
            names = proto.native_names(req)
            self._check_model(req.model)
            require_generation_model(self.client.info)  # before the chat template is rendered
            job = (
                await self.chat_job(req)
                if cls is proto.ChatCompletionRequest
                else self._completion_job(req)
            )
            gen = self.client.generate(job.obj)
            if req.is_stream:
                # The first chunk comes after admission and prefill: errors up to there
                # are still an ordinary error response.
                try:
                    first = await gen.__anext__()
                except StopAsyncIteration:
                    first = None
                return OpenAIStream(self._stream(job, gen, first))
            result = await native_api.last_result(gen)
            return _ok(self._response(job, result if isinstance(result, list) else [result]))
        except (InvalidParameter, RequestError) as e:
            return OpenAIResponse(*_error(e, names))
        except Exception as e:
            logger.exception("OpenAI request failed")
            return error_response(request_fault("serving the request", e))

    def _served_names(self) -> tuple[str, ...]:
        info = self.client.info
        return info.served_model_names or (info.served_model_name,)

    def _check_model(self, model: str | None) -> None:
        """Any model name is served by the one model, as SGLang does; with
        --strict-model-name a name that is not served is a 404."""
        if model is None or not getattr(self.state.args, "strict_model_name", False):
            return
        if model not in self._served_names():
            served = ", ".join(map(repr, self._served_names()))
            raise RequestError(
                404, f"The model {model!r} does not exist; this server serves {served}", "model"
            )

    def _model_card(self, name: str) -> dict:
        info = self.client.info
        return {
            "id": name,
            "object": "model",
            "created": int(getattr(self.state, "started", 0)),
            "owned_by": "cadence",
            "root": info.served_model_name,
            "parent": None,
            "max_model_len": info.context_len,
            "capabilities": server_capabilities(self.state),
        }

    async def chat_job(self, req: proto.ChatCompletionRequest) -> _Job:
        """A chat request rendered, tokenized and checked as a job (also for chat with audio)."""
        check_message_count("messages", len(req.messages or ()), self.client.info)
        messages = chat_tools.template_messages(proto.chat_messages(req.messages))
        plan = chat_tools.plan(
            req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser
        )
        input_ids = await self.render_chat(
            messages, proto.template_options(req), "messages", plan.template_tools
        )
        _, max_tokens = proto.requested_max_tokens(req)
        if max_tokens is None:  # OpenAI's default: whatever the context leaves
            max_tokens = max(self.client.info.context_len - len(input_ids), 1)
        rid = proto.single_rid(req) or uuid.uuid4().hex
        params = proto.sampling_params(req, max_tokens, plan.constraint)
        if isinstance(plan.parser, Llama3Parser) and req.skip_special_tokens is None:
            params["skip_special_tokens"] = False  # <|python_tag|> is a special token
        obj = GenerateReqInput(
            input_ids=input_ids,
            sampling_params=params,
            rid=rid,
            return_logprob=bool(req.logprobs),
            top_logprobs_num=req.top_logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.is_stream,
            **proto.extras(req),
        )
        reasoning = None
        if self.reasoning_parser and req.separate_reasoning is not False:
            reasoning = reasoning_parser(self.reasoning_parser)
        return _Job(
            req,
            obj,
            f"chatcmpl-{rid}",
            req.model or self.client.info.served_model_name,  # echoed, as SGLang does
            proto.native_names(req),
            num_choices=req.n or 1,
            answer=ChatAnswer(
                plan,
                reasoning,
                req.stream_reasoning is not False,
                is_constrained=any(params.get(k) for k in ("json_schema", "regex", "ebnf")),
            ),
        )

    def _completion_job(self, req: proto.CompletionRequest) -> _Job:
        prompt = proto.prompt_fields(req.prompt)
        is_batch = isinstance(prompt.get("text"), list) or (
            "input_ids" in prompt and isinstance(prompt["input_ids"][0], list)
        )
        num_prompts = len(next(iter(prompt.values()))) if is_batch else 1
        max_tokens = (
            req.max_tokens if req.max_tokens is not None else proto.COMPLETION_DEFAULT_MAX_TOKENS
        )
        base = uuid.uuid4().hex
        rids = [f"{base}-p{i}" for i in range(num_prompts)] if is_batch else base
        if req.rid is not None:  # SGLang's extra: the client names its request(s)
            rids = proto.completion_rids(req, num_prompts, is_batch)
        # With logprobs and echo, the prompt's own logprobs come first (from position 0).
        wants_logprobs = req.logprobs is not None
        obj = GenerateReqInput(
            **prompt,
            sampling_params=proto.sampling_params(req, max_tokens),
            rid=rids,
            return_logprob=wants_logprobs,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if wants_logprobs and req.echo else -1,
            return_text_in_logprobs=True,
            stream=req.is_stream,
            **proto.extras(req),
        )
        job = _Job(
            req,
            obj,
            f"cmpl-{base}",
            req.model or self.client.info.served_model_name,  # echoed, as SGLang does
            proto.native_names(req),
            num_choices=num_prompts * (req.n or 1),
        )
        if req.echo:
            prompts = prompt.get("text", prompt.get("input_ids"))
            prompts = prompts if is_batch else [prompts]
            # The prompt as it was sent, special tokens included (as vLLM echoes it).
            job.prompt_texts = [
                p
                if isinstance(p, str)
                else self.client.tokenizer.decode(p, skip_special_tokens=False)
                for p in prompts
            ]
        return job

    # ---- results → OpenAI shapes ------------------------------------------------------------

    def _response(self, job: _Job, results: list[dict]) -> dict:
        choices = [self._choice(job, i, r) for i, r in enumerate(results)]
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

    def _choice(self, job: _Job, index: int, result: dict) -> dict:
        meta = result["meta_info"]
        reason = meta.get("finish_reason")
        choice: dict[str, Any] = {"index": index}
        finish_reason = proto.finish_reason(reason)
        if job.is_chat:
            choice["message"], finish_reason = job.answer.message(result["text"], finish_reason)
            choice["logprobs"] = self._chat_logprobs(job, meta)
        else:
            echo = job.echo_text(index)
            choice["text"] = echo + result["text"]
            choice["logprobs"] = self._completion_logprobs(job, meta, 0, with_prompt=True)
        choice["finish_reason"] = finish_reason
        choice["matched_stop"] = proto.matched_stop(reason)
        hidden = meta.get("hidden_states")
        if job.req.return_hidden_states and hidden:
            # As SGLang: the last position's hidden state (the prompt block's last row when
            # nothing was decoded after the first token).
            last = hidden[-1]
            choice["hidden_states"] = last[-1] if last and isinstance(last[0], list) else last
        return choice

    def _chat_logprobs(self, job: _Job, meta: dict) -> dict | None:
        if not job.req.logprobs:
            return None
        return proto.chat_logprobs(
            meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs")
        )

    def _completion_logprobs(
        self, job: _Job, meta: dict, offset: int, with_prompt: bool
    ) -> dict | None:
        req = job.req
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

    async def _stream(
        self, job: _Job, gen: AsyncIterator, first: dict | None
    ) -> AsyncIterator[dict]:
        """The chunks of a stream; ends the engine request if left early."""
        counts: dict[int, dict] = {}  # choice index -> its latest meta (counts are cumulative)
        offsets: dict[int, int] = {}  # choice index -> chars of text sent so far (logprob offsets)
        answers: dict[int, ChatAnswerStream] = {}  # chat: choice index -> its answer so far
        kind = "chat.completion.chunk" if job.is_chat else "text_completion"

        def chunk(choices: list, **extra) -> dict:
            out = {
                "id": job.id,
                "object": kind,
                "created": job.created,
                "model": job.model,
                "choices": choices,
            }
            if job.req.include_usage:
                out["usage"] = None
            out.update(extra)
            return out

        try:
            if job.is_chat:
                # Nothing is generated yet: the usage so far is the prompt's alone.
                start = dict(first["meta_info"], completion_tokens=0) if first else None
                usage = self._continuous_usage(job, start)
                for i in range(job.num_choices):
                    yield chunk(
                        [
                            {
                                "index": i,
                                "delta": {
                                    "role": "assistant",
                                    "content": "",
                                    "reasoning_content": None,
                                },
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        **({"usage": usage} if usage else {}),
                    )
            pending = [first] if first is not None else []
            while True:
                if pending:
                    delta = pending.pop()
                else:
                    try:
                        delta = await gen.__anext__()
                    except StopAsyncIteration:
                        break
                index = delta.get("index", 0)
                counts[index] = delta["meta_info"]
                usage = self._continuous_usage(job, delta["meta_info"])
                for choice in self._delta_choices(job, index, delta, offsets, answers):
                    yield chunk([choice], **({"usage": usage} if usage else {}))
            if job.req.include_usage:
                metas = [counts[i] for i in sorted(counts)]
                firsts = metas[:: job.n]
                yield chunk(
                    [],
                    usage=proto.usage(
                        sum(m["prompt_tokens"] for m in firsts),
                        sum(m["completion_tokens"] for m in metas),
                        sum(m.get("cached_tokens", 0) for m in firsts),
                    ),
                )
        finally:
            await gen.aclose()

    @staticmethod
    def _continuous_usage(job: _Job, meta: dict | None) -> dict | None:
        """stream_options {include_usage, continuous_usage_stats}: the usage so far of the
        chunk's choice on every chunk, as vLLM sends it (continuous_usage_stats alone adds
        nothing: usage is only sent when include_usage asks for it)."""
        options = job.req.stream_options
        if not (meta and job.req.include_usage and options.continuous_usage_stats):
            return None
        return proto.usage(
            meta["prompt_tokens"], meta["completion_tokens"], meta.get("cached_tokens", 0)
        )

    def _delta_choices(
        self,
        job: _Job,
        index: int,
        delta: dict,
        offsets: dict[int, int],
        answers: dict[int, ChatAnswerStream],
    ) -> list[dict]:
        """The choices a delta becomes: none (nothing to say yet) or one; for chat, its
        content, reasoning_content and tool_calls. The last one carries the finish_reason
        together with the last text, as vLLM and OpenAI send it; its delta always has a
        `content` string ("" when nothing is left to say) and SGLang's null fields, so
        clients reading `delta.content` of every chunk, and typed clients, work."""
        meta = delta["meta_info"]
        reason = meta.get("finish_reason")
        if not job.is_chat:
            choice = self._delta_choice(job, index, delta, offsets)
            return [] if choice is None else [choice]
        text = delta["text"]
        offsets[index] = offsets.get(index, 0) + len(text)
        answer = answers.get(index)
        if answer is None:
            answer = answers[index] = job.answer.stream()
        delta_fields = answer.update(text, is_final=reason is not None)
        logprobs = self._chat_logprobs(job, meta)
        if reason is None and not (delta_fields or (logprobs and logprobs["content"])):
            return []
        delta_fields.setdefault("reasoning_content", None)
        finish = proto.finish_reason(reason)
        if reason is not None:
            delta_fields.setdefault("content", "")
            delta_fields.setdefault("tool_calls", None)
            if finish == "stop" and answer.has_tool_calls:
                finish = "tool_calls"
        choice = {
            "index": index,
            "delta": delta_fields,
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": proto.matched_stop(reason),
        }
        return [choice]

    def _delta_choice(
        self, job: _Job, index: int, delta: dict, offsets: dict[int, int]
    ) -> dict | None:
        """A completions delta as its choice (None: nothing to say yet)."""
        meta = delta["meta_info"]
        reason = meta.get("finish_reason")
        text = delta["text"]
        is_first = index not in offsets
        if is_first:
            text = job.echo_text(index) + text
        offset = offsets.get(index, 0)
        logprobs = self._completion_logprobs(job, meta, offset, with_prompt=is_first)
        if not text and reason is None and not (logprobs and logprobs["tokens"]):
            return None
        offsets[index] = offset + len(text)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": proto.finish_reason(reason),
            "matched_stop": proto.matched_stop(reason),
        }


# -- helpers ------------------------------------------------------------------------------------


def _ok(obj: dict) -> OpenAIResponse:
    return OpenAIResponse(200, msgspec.json.encode(obj))


def error_response(e: Exception, names: dict[str, str] | None = None) -> OpenAIResponse:
    """The OpenAI error answer for an InvalidParameter or RequestError; `names` maps native
    field names to the request's own (see `_error`)."""
    return OpenAIResponse(*_error(e, names))


def _error(e: Exception, names: dict[str, str] | None = None) -> tuple[int, bytes, bool]:
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


def _read_chat_template(path: str) -> str:
    import jinja2

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--chat-template: cannot read {path}: {e.strerror}") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"--chat-template: {path} is not a valid Jinja template (line {e.lineno}): {e}"
        ) from None
    return text
