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

This module turns a request into a `Job` (its prompt rendered and tokenized, its sampling
fields) and runs it; `openai_results` turns what the job produced into OpenAI's shapes.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from cadence.errors import InvalidParameter, RequestError
from cadence.front.engine_client import EngineClient
from cadence.front.lora import split_model
from cadence.front.request_checks import (
    check_message_count,
    check_prompt_chars,
    require_generation_model,
)
from cadence.io_struct import GenerateReqInput, LoRAAdapterInfo
from cadence.parsers import reasoning_parser
from cadence.parsers.tool_calls import Llama3Parser
from cadence.serving import chat_tools, native_api, speech_chat
from cadence.serving import openai_protocol as proto
from cadence.serving.chat_answer import ChatAnswer
from cadence.serving.errors import request_fault
from cadence.serving.openai_results import (
    Job,
    OpenAIResponse,
    OpenAIResult,
    OpenAIStream,
    error_response,
    ok,
    response_body,
    stream_chunks,
)
from cadence.serving.speech_serving import server_capabilities

logger = logging.getLogger(__name__)


class OpenAIServing:
    """Serves the OpenAI API over the front process's `EngineClient`.

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

    async def list_models(self) -> OpenAIResponse:
        """The served names' cards, then one card per loaded LoRA adapter (its `parent` the
        served model, its `root` the adapter's directory)."""
        cards = [self._model_card(name) for name in self._served_names()]
        cards += [self._adapter_card(a) for a in await self._loaded_adapters()]
        return ok({"object": "list", "data": cards})

    async def retrieve_model(self, model_id: str) -> OpenAIResponse:
        """A served name's or a loaded adapter's card; any other name is 404 (a model list
        is a contract, even when requests naming other models are served)."""
        if model_id in self._served_names():
            return ok(self._model_card(model_id))
        for adapter in await self._loaded_adapters():
            if adapter.name == model_id:
                return ok(self._adapter_card(adapter))
        error = RequestError(
            404,
            f"The model {model_id!r} does not exist; this server serves "
            f"{', '.join(map(repr, self._served_names()))} and the LoRA adapters "
            "/v1/models lists",
            "model",
        )
        return error_response(error)

    async def _loaded_adapters(self) -> list[LoRAAdapterInfo]:
        """The adapters loaded now, as the scheduler reports them (another front process
        may have loaded one); the front's copy when the scheduler does not answer."""
        client = self.client
        if not client.info.lora_enabled:
            return []
        try:
            return await client.list_lora_adapters()
        except RequestError as e:
            logger.warning("listing the LoRA adapters from this front's copy: %s", e)
            return list(client.lora.adapters.values())

    async def chat_completions(self, body: bytes) -> OpenAIResult:
        if speech_chat.wants_audio(body):  # modalities ["text", "audio"]: docs/speech.md
            try:
                answer = await speech_chat.chat_with_audio(self, body)
            except (InvalidParameter, RequestError) as e:
                return error_response(e)
            return ok(answer) if isinstance(answer, dict) else OpenAIStream(answer)
        return await self._serve(body, proto.ChatCompletionRequest)

    async def completions(self, body: bytes) -> OpenAIResult:
        return await self._serve(body, proto.CompletionRequest)

    # ---- shared with the other OpenAI APIs (serving.responses) -----------------------------

    def check_model(self, model: str | None) -> None:
        """Raises the 404 RequestError (param `model`) if this server refuses the name."""
        self._check_model(model)

    async def resolve_model(self, model: str | None, lora_path: Any = None) -> Any:
        """The request's `lora_path` once `model` is checked: the adapter `model` names
        (`base:adapter`, or the adapter's own name) wins over the explicit `lora_path`
        field (SGLang's order). A `base:adapter` naming no loaded adapter is a 400 naming
        `model`; with --strict-model-name the base must be a served name."""
        served = self._served_names()
        adapter = await self.client.lora.model_adapter(model, served)
        if adapter is None:
            self._check_model(model)
            return lora_path
        base, _ = split_model(model, served)
        if base is not None and base != adapter:  # `base:adapter`, not the adapter alone
            self._check_model(base)
        return adapter

    def refuse_lora(self, model: str | None, lora_path: Any, what: str) -> None:
        """A 400 for a request of a kind LoRA adapters do not serve (`what`: embeddings,
        ...) that names one, in `model` or `lora_path`; else the model check."""
        adapter = self.client.lora.names_adapter(model, self._served_names())
        for param, value in (("model", adapter), ("lora_path", lora_path)):
            if value is not None:
                raise InvalidParameter(
                    param,
                    f"{param}: {what} run on the base model only; LoRA adapters (here "
                    f"{value!r}) serve generation (/generate, /v1/chat/completions, "
                    "/v1/completions)",
                )
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
            lora_path = await self.resolve_model(req.model, req.lora_path)
            require_generation_model(self.client.info)  # before the chat template is rendered
            job = (
                await self.chat_job(req, lora_path)
                if cls is proto.ChatCompletionRequest
                else self._completion_job(req, lora_path)
            )
            gen = self.client.generate(job.obj)
            if req.is_stream:
                # The first chunk comes after admission and prefill: errors up to there
                # are still an ordinary error response.
                try:
                    first = await gen.__anext__()
                except StopAsyncIteration:
                    first = None
                return OpenAIStream(stream_chunks(job, gen, first))
            result = await native_api.last_result(gen)
            return ok(response_body(job, result if isinstance(result, list) else [result]))
        except (InvalidParameter, RequestError) as e:
            return error_response(e, names)
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

    def _adapter_card(self, adapter: LoRAAdapterInfo) -> dict:
        """An adapter's card, as SGLang lists it: the base model is its parent."""
        return {
            **self._model_card(adapter.name),
            "root": adapter.path,
            "parent": self.client.info.served_model_name,
        }

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

    async def chat_job(self, req: proto.ChatCompletionRequest, lora_path: Any = None) -> Job:
        """A chat request rendered, tokenized and checked as a job (also for chat with
        audio); `lora_path` is the adapter `resolve_model` chose."""
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
            lora_path=lora_path,
            **proto.extras(req),
        )
        return Job(
            req,
            obj,
            f"chatcmpl-{rid}",
            req.model or self.client.info.served_model_name,  # echoed, as SGLang does
            proto.native_names(req),
            num_choices=req.n or 1,
            answer=self._chat_answer(req, plan, params),
        )

    def _chat_answer(self, req: proto.ChatCompletionRequest, plan, params: dict) -> ChatAnswer:
        """How the generated text becomes the assistant message (tool calls, reasoning)."""
        reasoning = None
        if self.reasoning_parser and req.separate_reasoning is not False:
            reasoning = reasoning_parser(self.reasoning_parser)
        return ChatAnswer(
            plan,
            reasoning,
            req.stream_reasoning is not False,
            is_constrained=any(params.get(k) for k in ("json_schema", "regex", "ebnf")),
        )

    def _completion_job(self, req: proto.CompletionRequest, lora_path: Any = None) -> Job:
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
            lora_path=lora_path,
            **proto.extras(req),
        )
        job = Job(
            req,
            obj,
            f"cmpl-{base}",
            req.model or self.client.info.served_model_name,  # echoed, as SGLang does
            proto.native_names(req),
            num_choices=num_prompts * (req.n or 1),
        )
        if req.echo:
            prompts = prompt.get("text", prompt.get("input_ids"))
            job.prompt_texts = self._echo_texts(prompts if is_batch else [prompts])
        return job

    def _echo_texts(self, prompts: list) -> list[str]:
        """The prompts as they were sent, special tokens included (as vLLM echoes them)."""
        decode = self.client.tokenizer.decode
        return [p if isinstance(p, str) else decode(p, skip_special_tokens=False) for p in prompts]


# -- helpers ------------------------------------------------------------------------------------


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
