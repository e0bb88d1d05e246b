"""Request and response shapes of the OpenAI-compatible routes, and the pure functions
that turn one into a `GenerateReqInput` and TokenizerManager results into the other.

No I/O and nothing heavy: `openai_serving` drives the TokenizerManager with these, and
unit tests check them without a model. Every user error is an `InvalidParameter` whose
`param` is the OpenAI field at fault (never one of our native names).

Checks made here are the OpenAI-specific ones (types, unknown fields, `top_logprobs`
range, ...); the ranges of the sampling parameters are checked once, below both
adapters, by `SamplingParams.verify`, and `openai_serving` renames the native field in
those errors (`max_new_tokens` becomes `max_tokens`, ...).
"""

from __future__ import annotations

from typing import Any

import msgspec

from cadence.errors import InvalidParameter
from cadence.front.sampling_checks import MAX_LOGIT_BIAS_ENTRIES
from cadence.serving import chat_tools
from cadence.serving.body import parse_body

MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

ROLES = ("system", "developer", "user", "assistant", "tool")

# apply_chat_template's own arguments; chat_template_kwargs must not smuggle them in.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None  # add a last chunk with the usage of the whole request
    continuous_usage_stats: bool | None = None  # the usage so far on every content chunk
    include_obfuscation: bool | None = None  # accepted; this server never pads chunks


class _Request(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions. None everywhere means "not given"."""

    model: str | None = None  # the served model name; None means the served model
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    user: str | None = None  # accepted, not used
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    # SGLang's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None  # a schema object or its JSON text
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    # SGLang's request extras
    rid: str | list[str] | None = None  # the request id(s), for /abort_request and logs
    priority: int | None = None  # with --enable-priority-scheduling
    return_hidden_states: bool | None = None  # with --enable-return-hidden-states
    custom_logit_processor: str | None = None  # a plugin's processor, by name
    custom_params: dict[str, Any] | None = None  # for the custom logit processor
    # The LoRA adapter by name (one per prompt for a batch of completions); an adapter
    # named in `model` ("base:adapter", or its own name) wins over it, as in SGLang.
    lora_path: str | list[str | None] | None = None
    # Prefill/decode disaggregation (SGLang's extras, set by a PD router): the prefill
    # server's host and bootstrap port, and the room pairing the request's two halves.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Request, kw_only=True):
    messages: list[Any]
    max_completion_tokens: int | None = None  # wins over max_tokens when both are given
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # text; json_object / json_schema ({"name", "schema", "strict"}) become a json_schema
    # constraint (always enforced; `strict` is accepted either way)
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None  # default true
    continue_final_message: bool | None = None  # default false
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    tools: list[Any] | None = None  # [{"type": "function", "function": {name, parameters}}]
    # "none" | "auto" (the default with tools) | "required" | {"type": "function",
    # "function": {"name"}}; required and named choices are enforced with a grammar
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    store: bool | None = None  # accepted, not used
    metadata: dict[str, Any] | None = None  # accepted, not used
    service_tier: str | None = None  # accepted, not used
    # Reasoning output (`reasoning_content`) comes with a --reasoning-parser; without one these
    # change nothing.
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[Any]  # str, list of str, list of token ids, or list of such lists
    logprobs: int | None = None  # top alternatives per token, in [0, MAX_TOP_LOGPROBS]
    echo: bool | None = None  # answer with the prompt before the completion
    suffix: str | None = None  # refused: no insertion
    best_of: int | None = None  # only equal to n (or 1)


# -- parsing --------------------------------------------------------------------------------


def parse_request(cls: type, body: bytes | str | dict) -> Any:
    """Decode and type-check a request body; `InvalidParameter` names the field at fault."""
    required = "messages" if cls is ChatCompletionRequest else "prompt"
    req = parse_body(cls, body, {required: f"{required} is required"})
    _check_common(req)
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)
    else:
        _check_completion(req)
    return req


def _check_common(req: _Request) -> None:
    # OpenAI's range; the engine itself takes any temperature >= 0.
    if req.temperature is not None and not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise InvalidParameter(
            "temperature",
            f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), "
            f"got {req.temperature:g}",
        )
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter(
            "stream_options", "stream_options is only allowed when stream is true"
        )
    if len(req.logit_bias or ()) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParameter(
            "logit_bias",
            f"logit_bias has {len(req.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} "
            "are allowed",
        )
    for token_id, bias in (req.logit_bias or {}).items():
        if not -100 <= bias <= 100:
            raise InvalidParameter(
                "logit_bias", f"logit_bias[{token_id}] must be in [-100, 100], got {bias}"
            )


def _check_chat(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParameter(
                "top_logprobs",
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
            )
        if req.top_logprobs and not req.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs: true")
    chat_tools.check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if req.response_format is not None:
        _check_response_format(req.response_format)
    if is_forced_tool_choice(req) and (
        _json_schema(req) is not None or req.regex is not None or req.ebnf is not None
    ):
        raise InvalidParameter(
            "tool_choice",
            "tool_choice required or a named function constrains the answer to a tool call; "
            "it cannot be combined with response_format, json_schema, regex or ebnf",
        )
    for name in req.chat_template_kwargs or {}:
        if name in _RESERVED_TEMPLATE_KWARGS:
            raise InvalidParameter(
                "chat_template_kwargs", f"chat_template_kwargs cannot set {name!r}"
            )


def _check_response_format(fmt: dict[str, Any]) -> None:
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidParameter(
            "response_format",
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        )
    if kind != "json_schema":
        return
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidParameter(
            "response_format", "response_format.json_schema.schema must be an object"
        )
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidParameter(
            "response_format", "response_format.json_schema.name must be a non-empty string"
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidParameter(
            "response_format", "response_format.json_schema.strict must be true or false"
        )


def is_forced_tool_choice(req: _Request) -> bool:
    """tool_choice "required" or a named function: the answer must be a tool call."""
    choice = getattr(req, "tool_choice", None)
    return bool(getattr(req, "tools", None)) and (choice == "required" or isinstance(choice, dict))


def _check_completion(req: CompletionRequest) -> None:
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidParameter(
            "logprobs", f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}"
        )
    if req.suffix:
        raise InvalidParameter(
            "suffix", "suffix: insertion is not supported by this server; remove it"
        )
    if req.best_of is not None and req.best_of not in (1, req.n or 1):
        raise InvalidParameter(
            "best_of",
            f"best_of must equal n ({req.n or 1}): this server returns every sample it generates",
        )
    prompt_fields(req.prompt)


# -- request → GenerateReqInput pieces --------------------------------------------------------


def prompt_fields(prompt: Any) -> dict[str, Any]:
    """The `text=` or `input_ids=` of GenerateReqInput for a completions prompt."""
    if isinstance(prompt, str):
        return {"text": prompt}
    if not prompt:
        raise InvalidParameter("prompt", "prompt must not be an empty list")
    if all(isinstance(p, str) for p in prompt):
        return {"text": list(prompt)}
    if all(_is_int(t) for t in prompt):
        return {"input_ids": list(prompt)}
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return {"input_ids": [list(p) for p in prompt]}
    raise InvalidParameter(
        "prompt",
        "prompt must be a string, a list of strings, a list of token ids, "
        "or a list of non-empty lists of token ids",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content always a string."""
    if not messages:
        raise InvalidParameter("messages", "messages must not be empty")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidParameter(
                "messages", f"messages[{i}] must be an object with role and content"
            )
        role = message.get("role")
        if role not in ROLES:
            raise InvalidParameter(
                "messages", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}"
            )
        content = message.get("content")
        if content is None and role not in ("assistant", "tool"):
            raise InvalidParameter("messages", f"messages[{i}].content is required for role {role}")
        msg = dict(
            message,
            role="system" if role == "developer" else role,
            content=_text_content(i, content),
        )
        result.append(msg)
    return result


def _text_content(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter(
            "messages", f"messages[{i}].content must be a string or a list of content parts"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_audio", "file", "video_url"):
            raise InvalidParameter(
                "messages", f"messages[{i}].content[{j}]: this model does not accept {kind} input"
            )
        else:
            raise InvalidParameter(
                "messages",
                f'messages[{i}].content[{j}] must be a text part ({{"type": "text", "text": ...}})',
            )
    return "\n".join(texts)


def template_options(req: ChatCompletionRequest) -> dict[str, Any]:
    """Keyword arguments of apply_chat_template: the request's switches plus its kwargs."""
    extra = dict(req.chat_template_kwargs or {})
    options = {
        "add_generation_prompt": extra.pop("add_generation_prompt", req.add_generation_prompt),
        "continue_final_message": extra.pop("continue_final_message", req.continue_final_message),
    }
    if options["continue_final_message"]:
        options["add_generation_prompt"] = False  # continuing the last turn means no new one
    elif options["add_generation_prompt"] is None:
        options["add_generation_prompt"] = True
    options["continue_final_message"] = bool(options["continue_final_message"])
    return {**extra, **options}


def sampling_params(
    req: _Request, max_new_tokens: int, tool_constraint: dict | None = None
) -> dict[str, Any]:
    """The native sampling_params dict; fields the client left out keep the native defaults.
    `tool_constraint`: the JSON schema that a forced tool choice puts on the answer."""
    params = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens,
        "n": req.n,
        "stop": req.stop,
        "seed": req.seed,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": req.logit_bias,
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": req.stop_token_ids,
        "skip_special_tokens": req.skip_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "regex": req.regex,
        "json_schema": (
            msgspec.json.encode(tool_constraint).decode() if tool_constraint else _json_schema(req)
        ),
        "ebnf": req.ebnf,
        "stop_regex": req.stop_regex,
        "custom_params": req.custom_params,
    }
    return {k: v for k, v in params.items() if v is not None}


def _json_schema(req: _Request) -> str | None:
    schema = req.json_schema
    fmt = getattr(req, "response_format", None)
    if schema is None and fmt is not None:
        if fmt["type"] == "json_object":
            schema = {"type": "object"}
        elif fmt["type"] == "json_schema":
            schema = fmt["json_schema"]["schema"]
    if isinstance(schema, dict):
        return msgspec.json.encode(schema).decode()
    return schema


def extras(req: _Request) -> dict[str, Any]:
    """The GenerateReqInput fields of SGLang's request extras that the client set."""
    fields = {
        "priority": req.priority,
        "return_hidden_states": req.return_hidden_states,
        "custom_logit_processor": req.custom_logit_processor,
        "bootstrap_host": req.bootstrap_host,
        "bootstrap_port": req.bootstrap_port,
        "bootstrap_room": req.bootstrap_room,
    }
    return {name: value for name, value in fields.items() if value is not None}


def single_rid(req: _Request) -> str | None:
    """A chat request's own rid (one string: a chat is one prompt)."""
    if req.rid is not None and not isinstance(req.rid, str):
        raise InvalidParameter("rid", "rid must be a string for a chat completion")
    if req.rid == "":
        raise InvalidParameter("rid", "rid must not be empty")
    return req.rid


def completion_rids(req: _Request, num_prompts: int, is_batch: bool) -> str | list[str]:
    """A completion's rids: one string for one prompt, or one per prompt of a batch."""
    if not is_batch:
        return single_rid(req)
    if isinstance(req.rid, str):
        return [f"{req.rid}-p{i}" for i in range(num_prompts)]
    if len(req.rid) != num_prompts:
        raise InvalidParameter(
            "rid", f"rid has {len(req.rid)} entries but the request has {num_prompts} prompts"
        )
    return list(req.rid)


def requested_max_tokens(req: _Request) -> tuple[str, int | None]:
    """(the field the client used for the output length, its value or None)."""
    value = getattr(req, "max_completion_tokens", None)
    if value is not None:
        return "max_completion_tokens", value
    return "max_tokens", req.max_tokens


def native_names(req: _Request) -> dict[str, str]:
    """Native field → the OpenAI field it came from, for renaming errors raised below us."""
    prompt = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    names = {
        "max_new_tokens": requested_max_tokens(req)[0],
        "min_new_tokens": "min_tokens",
        "text": prompt,
        "input_ids": prompt,
        "top_logprobs_num": "top_logprobs" if prompt == "messages" else "logprobs",
        "logprob_start_len": "echo",
    }
    if req.json_schema is None and getattr(req, "response_format", None) is not None:
        names["json_schema"] = "response_format"
    if is_forced_tool_choice(req):
        names["json_schema"] = "tools"  # the constraint is built from the tools' schemas
    return names


# -- results → response pieces ----------------------------------------------------------------


def finish_reason(reason: dict | None) -> str | None:
    """OpenAI's finish_reason for a native one: stop (EOS, stop token or string), length, abort."""
    if reason is None:
        return None
    kind = reason.get("type")
    return kind if kind in ("stop", "length") else "abort"


def matched_stop(reason: dict | None) -> Any:
    return reason.get("matched") if reason and reason.get("type") == "stop" else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(token_logprobs: list, top_logprobs: list | None) -> dict[str, Any]:
    """`choices[i].logprobs` of chat: one entry per generated token, with its alternatives.

    `token_logprobs` holds [logprob, id, text] per token; `top_logprobs` a list of such
    triples per token (None or shorter when not asked for)."""
    content = []
    for k, (logprob, _, text) in enumerate(token_logprobs):
        tops = top_logprobs[k] if top_logprobs and k < len(top_logprobs) and top_logprobs[k] else []
        content.append(
            {
                "token": text,
                "logprob": logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                    for lp, _, t in tops
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    token_logprobs: list, top_logprobs: list | None, num_top: int, text_offset: int
) -> dict[str, Any]:
    """`choices[i].logprobs` of legacy completions; offsets index the choice's `text`,
    starting at `text_offset` (the length of what came before in that text)."""
    tokens, values, tops, offsets = [], [], [], []
    for k, (logprob, _, text) in enumerate(token_logprobs):
        tokens.append(text)
        values.append(logprob)
        offsets.append(text_offset)
        text_offset += len(text)
        row = top_logprobs[k] if top_logprobs and k < len(top_logprobs) else None
        # The first prompt token has no logprob, hence no alternatives either.
        tops.append({t: lp for lp, _, t in row[:num_top]} if row and logprob is not None else None)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops if num_top else None,
        "text_offset": offsets,
    }
