"""The native API's answers, computed once for both adapters (HTTP routes and gRPC RPCs).

Each function takes what the front process already holds (the `ServerState`, its
`EngineClient`, a load report) and returns plain Python values; the adapters only encode
them. Tokenize and detokenize run here, in the front process: the scheduler is never
involved. Bad input raises `InvalidParameter`, which each adapter maps to its own error
(HTTP 400, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from cadence.errors import InvalidParameter
from cadence.front.engine_client import EngineClient, ModelInfo
from cadence.front.request_checks import (
    MAX_TOKENIZER_ITEMS,
    check_message_count,
    check_tokenize_chars,
)
from cadence.io_struct import GenerateReqInput
from cadence.server_args import ServerArgs
from cadence.serving.body import json_object, parse_struct
from cadence.version import __version__

logger = logging.getLogger(__name__)

LOAD_FIELDS = (
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_used_tokens",
    "num_cached_tokens",
    "max_total_num_tokens",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "spec_accept_length",
    "spec_accept_rate",
)


async def last_result(results: AsyncIterator):
    """The last item of `results` (a non-streamed generation yields exactly one)."""
    result = None
    async for result in results:  # noqa: B007 (the last one is the answer)
        pass
    return result


def generate_input(body: Any) -> GenerateReqInput:
    """The /generate body (decoded) as a request struct, not yet normalized (the engine
    client checks it); InvalidParameter names a field of the wrong type."""
    return parse_struct(GenerateReqInput, body)


_LOGPROB_FIELDS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
)


async def cumulative(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """A /generate stream as SGLang sends it by default: each event carries the text, the
    output ids and the logprob lists so far (per `index` for a batch), not only what is
    new. The engine yields deltas; `--incremental-streaming-output` sends those as they are."""
    so_far: dict[int, dict] = {}
    try:
        async for chunk in chunks:
            index = chunk.get("index", 0)
            total = so_far.setdefault(index, {"text": "", "output_ids": [], "logprobs": {}})
            total["text"] += chunk["text"]
            total["output_ids"].extend(chunk["output_ids"])
            meta = dict(chunk["meta_info"])
            for name in _LOGPROB_FIELDS:
                if name in meta:
                    meta[name] = total["logprobs"].setdefault(name, []) + list(meta[name] or [])
                    total["logprobs"][name] = meta[name]
            out = {
                "text": total["text"],
                "output_ids": list(total["output_ids"]),
                "meta_info": meta,
            }
            if "index" in chunk:
                out["index"] = index
            yield out
    finally:
        await chunks.aclose()


def model_info(info: ModelInfo, args: ServerArgs, weight_version: str) -> dict[str, Any]:
    """GET /model_info; GetModelInfo's json_info, with SGLang's fields from the launch line
    (--preferred-sampling-params, as given) and the served `weight_version` (the
    scheduler's)."""
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.tokenizer_path,
        "served_model_name": info.served_model_name,
        "is_generation": info.is_generation,
        "max_context_length": info.context_len,
        "vocab_size": info.vocab_size,
        # What each tensor type of the file is served as (a GGUF's Q4_1 kept as Q4_1, ...).
        "weight_types": info.weight_types,
        "preferred_sampling_params": args.preferred_sampling_params,
        "weight_version": weight_version,
    }


async def server_info(state) -> dict[str, Any]:
    """GET /server_info; GetServerInfo's json_info, in SGLang's shape: the effective server
    arguments at the top level, the scheduler's facts (`max_total_num_tokens`,
    `max_req_input_len`, `kv_pool_bytes`, ...), `internal_states` (one dict per
    data-parallel rank) and `version`."""
    body = state.args.to_dict()
    body.pop("api_key", None)  # never echo a secret
    info = state.client.info if state.client is not None else None
    if info is not None:  # the default model, or names left to the loader: what was loaded
        loaded = {
            "model_path": info.model_path,
            "tokenizer_path": info.tokenizer_path or info.model_path,
            "served_model_name": info.served_model_name,
        }
        body.update({k: v for k, v in loaded.items() if body.get(k) is None})
    runtime = dict(state.runtime)
    body.update(version=__version__, is_ready=state.is_ready, uptime_s=time.time() - state.started)
    body.update(runtime)
    if "max_total_tokens" in runtime:
        body["max_total_num_tokens"] = runtime["max_total_tokens"]
        body["max_req_input_len"] = runtime["context_len"] - 1
    body["status"] = "ready" if state.is_ready else "starting"
    memory = {"token_capacity": runtime.get("max_total_tokens")}
    if "kv_pool_bytes" in runtime:  # SGLang's figure: the KV cache's memory in GB
        memory["kvcache"] = round(runtime["kv_pool_bytes"] / 2**30, 2)
    rank = {"dp_rank": 0, "memory_usage": memory}
    if state.is_ready and state.client is not None and not state.is_shutting_down:
        [load] = await state.client.get_load(timeout=10)
        rank.update(
            last_gen_throughput=load.gen_throughput,
            num_running_reqs=load.num_running_reqs,
            num_waiting_reqs=load.num_waiting_reqs,
            token_usage=load.token_usage,
        )
        if load.avg_spec_accept_length is not None:  # speculative decoding is on
            rank["avg_spec_accept_length"] = load.avg_spec_accept_length
    body["internal_states"] = [rank]
    return body


async def metrics_body(state) -> bytes:
    """GET /metrics in Prometheus text format: what the front processes count (all of them
    with --api-workers) and the scheduler's gauges, asked for now."""
    from cadence.front import metrics

    load, client = None, state.client
    if client is not None and state.is_ready and not state.is_shutting_down:
        try:
            load = load_entries(await client.get_load(timeout=5.0))[0]
        except Exception:  # a scrape never fails for want of the gauges
            logger.warning("/metrics: the scheduler did not report its load", exc_info=True)
    model = client.info.served_model_name if client is not None else ""
    return metrics.render(load, model)


MAX_DP_RANK = 2**31 - 1  # an int32, as gRPC's dp_rank field is


def check_dp_rank(value: int | str | None) -> int | None:
    """A `dp_rank` filter (a query parameter's text, or gRPC's int32) as a rank; anything
    but a whole number in [0, 2^31-1] is an InvalidParameter naming it."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= len(str(MAX_DP_RANK))):
            raise InvalidParameter(
                "dp_rank",
                f"dp_rank must be a whole number from 0 to {MAX_DP_RANK}, got {value[:40]!r}",
            )
        value = int(text)
    if not 0 <= value <= MAX_DP_RANK:
        raise InvalidParameter(
            "dp_rank", f"dp_rank must be a whole number from 0 to {MAX_DP_RANK}, got {value}"
        )
    return value


def load_entries(loads: list) -> list[dict[str, Any]]:
    """The /v1/loads entries of the ranks' load reports (`EngineClient.get_load`); a figure
    that does not apply (speculative decoding's, with it off) is left out."""
    return [
        {name: getattr(load, name) for name in LOAD_FIELDS if getattr(load, name) is not None}
        for load in loads
    ]


async def tokenize_body(state, body: Any) -> dict[str, Any]:
    """POST /tokenize (and /v1/tokenize), SGLang's shape: exactly one of `prompt` (a string
    or a list of strings) and `messages` (a chat, rendered with the chat template as a chat
    completion's prompt is), `add_special_tokens` (default true; a rendered chat already
    holds its special tokens). Answers {"tokens", "count", "max_model_len"}."""
    json_object(body)
    client: EngineClient = state.client
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidParameter("prompt", "give exactly one of prompt and messages")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise InvalidParameter(
            "add_special_tokens", f"add_special_tokens must be true or false, got {add_special!r}"
        )
    max_len = client.info.context_len
    if messages is not None:
        text = await _render_chat(state, body)
        [tokens] = await client.tokenize_batch([text], add_special_tokens=False, param="messages")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_len}
    if isinstance(prompt, str):
        [tokens] = await client.tokenize_batch([prompt], add_special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_len}
    if isinstance(prompt, list) and prompt:
        if len(prompt) <= MAX_TOKENIZER_ITEMS and not all(isinstance(p, str) for p in prompt):
            raise InvalidParameter(
                "prompt", "prompt must be a string or a non-empty list of strings"
            )
        tokens = await client.tokenize_batch(prompt, add_special)  # checks the count first
        return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": max_len}
    raise InvalidParameter("prompt", "prompt must be a string or a non-empty list of strings")


async def _render_chat(state, body: dict) -> str:
    """The /tokenize messages rendered with the chat template; a chat whose text alone is
    more than /tokenize takes is refused before it is rendered."""
    from cadence.serving import openai_protocol as proto

    raw = body["messages"] if isinstance(body["messages"], list) else None
    check_message_count("messages", len(raw or ()), state.client.info)
    messages = proto.chat_messages(raw)
    num_chars = sum(len(m["content"]) for m in messages)
    check_tokenize_chars("messages", num_chars, state.args.max_tokenize_chars)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidParameter("chat_template_kwargs", "chat_template_kwargs must be an object")
    options = {**kwargs}
    for name in ("add_generation_prompt", "continue_final_message"):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise InvalidParameter(name, f"{name} must be true or false, got {value!r}")
        options.setdefault(name, value)
    if options["continue_final_message"]:
        options["add_generation_prompt"] = False
    elif options["add_generation_prompt"] is None:
        options["add_generation_prompt"] = True
    options["continue_final_message"] = bool(options["continue_final_message"])
    try:
        return await state.client.tokenizer.render_chat_async(
            messages, chat_template=getattr(state, "chat_template", None), **options
        )
    except Exception as e:  # a template's raise_exception, or a malformed conversation
        raise InvalidParameter(
            "messages", f"the chat template rejected the messages: {e}"
        ) from None


async def detokenize_body(state, body: Any) -> dict[str, Any]:
    """POST /detokenize: {"tokens": [int] | [[int]], "skip_special_tokens"?} -> {"text": ...}."""
    json_object(body)
    tokens = body.get("tokens")
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise InvalidParameter(
            "skip_special_tokens", f"skip_special_tokens must be true or false, got {skip!r}"
        )
    if not isinstance(tokens, list):
        raise InvalidParameter(
            "tokens", "tokens must be a list of token ids or a list of such lists"
        )
    if tokens and isinstance(tokens[0], list):  # a list of lists: each one's text
        if len(tokens) <= MAX_TOKENIZER_ITEMS and not all(isinstance(t, list) for t in tokens):
            raise InvalidParameter(
                "tokens", "tokens must be a list of token ids or a list of such lists"
            )
        return {"text": await state.client.detokenize_batch(tokens, skip)}
    [text] = await state.client.detokenize_batch([tokens], skip)
    return {"text": text}
