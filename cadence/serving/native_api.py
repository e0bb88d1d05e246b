"""The native API's answers, computed once for both adapters (HTTP routes and gRPC RPCs).

Each function takes what the front process already holds (the `ServerState`, its
`EngineClient`, a load report) and returns plain Python values; the adapters only encode
them. Tokenize and detokenize run here, in the front process: the scheduler is never
involved. Bad input raises `InvalidParameter`, which each adapter maps to its own error
(HTTP 400, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from cadence.errors import InvalidParameter
from cadence.front.engine_client import EngineClient, ModelInfo
from cadence.front.normalize import from_json_dict
from cadence.io_struct import GenerateReqInput
from cadence.version import __version__

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
)


async def last_result(results: AsyncIterator):
    """The last item of `results` (a non-streamed generation yields exactly one)."""
    result = None
    async for result in results:  # noqa: B007 (the last one is the answer)
        pass
    return result


def generate_input(body: Any) -> GenerateReqInput:
    """The /generate body as a request struct (not yet normalized); InvalidParameter names
    an unknown field or a field of the wrong type."""
    return from_json_dict(GenerateReqInput, body)


def probe_request(text: str | None = None) -> GenerateReqInput:
    """A one-token greedy generation through the whole pipeline: the warm-up, /health_generate
    and gRPC HealthCheck all send this."""
    if text is not None:
        return GenerateReqInput(text=text, sampling_params={"max_new_tokens": 1, "temperature": 0})
    return GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})


def model_info(info: ModelInfo) -> dict[str, Any]:
    """GET /model_info; GetModelInfo's json_info."""
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.tokenizer_path,
        "served_model_name": info.served_model_name,
        "is_generation": info.is_generation,
        "max_context_length": info.context_len,
        "vocab_size": info.vocab_size,
    }


def server_info(state) -> dict[str, Any]:
    """GET /server_info; GetServerInfo's json_info: the effective arguments and runtime facts."""
    body = dataclasses.asdict(state.args)
    body.pop("api_key", None)  # never echo a secret
    body.update(
        version=__version__,
        is_ready=state.is_ready,
        uptime_s=time.time() - state.started,
        **state.runtime,
    )
    return body


def metrics_text(state) -> str:
    """GET /metrics in Prometheus text format: what the front process counts."""
    lines = [
        "# HELP cadence_request_faults_total Requests that ended in an internal error of their own "
        "(isolated: the server went on), by where it happened.",
        "# TYPE cadence_request_faults_total counter",
    ]
    faults = state.client.stats()["request_faults"] if state.client is not None else {}
    for origin, count in sorted(faults.items()):
        lines.append(f'cadence_request_faults_total{{origin="{origin}"}} {count}')
    return "\n".join(lines) + "\n"


def load_entries(load, dp_rank: int | None = None) -> list[dict[str, Any]]:
    """The /v1/loads entries (one per data-parallel rank), only rank `dp_rank` when given."""
    entries = [{name: getattr(load, name) for name in LOAD_FIELDS}]
    if dp_rank is not None:
        entries = [e for e in entries if e["dp_rank"] == dp_rank]
    return entries


async def tokenize_body(client: EngineClient, body: Any) -> dict[str, Any]:
    """POST /tokenize: {"prompt": str | [str], "add_special_tokens"?, "model"?} -> the answer."""
    if not isinstance(body, dict):
        raise InvalidParameter(None, "the request body must be a JSON object")
    unknown = set(body) - {"prompt", "add_special_tokens", "model"}
    if unknown:
        raise InvalidParameter(sorted(unknown)[0], f"unknown field {sorted(unknown)[0]!r}")
    prompt = body.get("prompt")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise InvalidParameter("add_special_tokens", "add_special_tokens must be a boolean")
    max_len = client.info.context_len
    if isinstance(prompt, str):
        tokens = await client.tokenize(prompt, add_special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_len}
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        tokens = [await client.tokenize(p, add_special) for p in prompt]
        return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": max_len}
    raise InvalidParameter("prompt", "prompt must be a string or a non-empty list of strings")


async def detokenize_body(client: EngineClient, body: Any) -> dict[str, Any]:
    """POST /detokenize: {"tokens": [int] | [[int]], "skip_special_tokens"?} -> {"text": ...}."""
    if not isinstance(body, dict):
        raise InvalidParameter(None, "the request body must be a JSON object")
    tokens = body.get("tokens")
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise InvalidParameter(
            "skip_special_tokens", f"skip_special_tokens must be true or false, got {skip!r}"
        )
    if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
        return {"text": [await detokenize(client, t, skip) for t in tokens]}
    return {"text": await detokenize(client, tokens, skip)}


async def detokenize(client: EngineClient, ids: Any, skip_special_tokens: bool = True) -> str:
    """The text of one list of token ids; ids must be ints inside the vocabulary."""
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise InvalidParameter(
            "tokens", "tokens must be a list of token ids or a list of such lists"
        )
    return await client.detokenize(ids, skip_special_tokens)
