"""The native API's answers, computed once for both adapters (HTTP routes and gRPC RPCs).

Each function takes what the front process already holds (the `ServerState`, the
`TokenizerManager`, a load report) and returns plain Python values; the adapters only
encode them. Tokenize and detokenize run here, in the front process: the scheduler is
never involved. Bad input raises `InvalidParameter`, which each adapter maps to its own
error (HTTP 400, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator

from cadence import __version__
from cadence.sampling_params import InvalidParameter

LOAD_FIELDS = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_cached_tokens",
               "max_total_num_tokens", "token_usage", "gen_throughput", "cache_hit_rate")


async def last_result(results: AsyncIterator):
    """The last item of `results` (a non-streamed generation yields exactly one)."""
    result = None
    async for result in results:
        pass
    return result


def model_info(info) -> dict[str, Any]:
    """GET /model_info; GetModelInfo's json_info. `info` is the TokenizerManager's ModelInfo."""
    return {"model_path": info.model_path, "tokenizer_path": info.tokenizer_path,
            "served_model_name": info.served_model_name, "is_generation": info.is_generation,
            "max_context_length": info.context_len, "vocab_size": info.vocab_size}


def server_info(state) -> dict[str, Any]:
    """GET /server_info; GetServerInfo's json_info: the effective arguments and runtime facts."""
    body = dataclasses.asdict(state.args)
    body.pop("api_key", None)  # never echo a secret
    body.update(version=__version__, is_ready=state.is_ready, uptime_s=time.time() - state.started,
                **state.runtime)
    return body


def metrics_text(state) -> str:
    """GET /metrics in Prometheus text format: what the front process counts."""
    lines = ["# HELP cadence_request_faults_total Requests that ended in an internal error of their own "
             "(isolated: the server went on), by where it happened.",
             "# TYPE cadence_request_faults_total counter"]
    faults = state.client.tm.num_request_faults if state.client is not None else {}
    for origin, count in sorted(faults.items()):
        lines.append(f'cadence_request_faults_total{{origin="{origin}"}} {count}')
    return "\n".join(lines) + "\n"


def load_entries(load, dp_rank: int | None = None) -> list[dict[str, Any]]:
    """The /v1/loads entries (one per data-parallel rank), only rank `dp_rank` when given."""
    entries = [{name: getattr(load, name) for name in LOAD_FIELDS}]
    if dp_rank is not None:
        entries = [e for e in entries if e["dp_rank"] == dp_rank]
    return entries


async def tokenize(tm, text: str, add_special_tokens: bool = True) -> list[int]:
    return await tm.encode_async(text, add_special_tokens)


async def tokenize_body(tm, body: Any) -> dict[str, Any]:
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
    max_len = tm.info.context_len
    if isinstance(prompt, str):
        tokens = await tokenize(tm, prompt, add_special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_len}
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        tokens = [await tokenize(tm, p, add_special) for p in prompt]
        return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": max_len}
    raise InvalidParameter("prompt", "prompt must be a string or a non-empty list of strings")


async def detokenize_body(tm, body: Any) -> dict[str, Any]:
    """POST /detokenize: {"tokens": [int] | [[int]], "skip_special_tokens"?} -> {"text": ...}."""
    if not isinstance(body, dict):
        raise InvalidParameter(None, "the request body must be a JSON object")
    tokens = body.get("tokens")
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise InvalidParameter("skip_special_tokens", f"skip_special_tokens must be true or false, got {skip!r}")
    if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
        return {"text": [await detokenize(tm, t, skip) for t in tokens]}
    return {"text": await detokenize(tm, tokens, skip)}


async def detokenize(tm, ids: Any, skip_special_tokens: bool = True) -> str:
    """The text of one list of token ids; ids must be ints inside the vocabulary."""
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidParameter("tokens", "tokens must be a list of token ids or a list of such lists")
    vocab = tm.info.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidParameter("tokens", f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})")
    return await tm.decode_async(ids, skip_special_tokens)


def abort(tm, rid: str | None, abort_all: bool, message: str) -> bool:
    """Aborts one request (and its n > 1 samples) or all; True when something live was hit."""
    if abort_all:
        tm.abort_request(abort_all=True, message=message)
        return True
    if not isinstance(rid, str) or not rid:
        raise InvalidParameter("rid", "give a rid (string) or abort_all: true")
    is_live = any(r == rid or r.startswith(f"{rid}-") for r in tm.states)
    tm.abort_request(rid, message=message)
    return is_live
