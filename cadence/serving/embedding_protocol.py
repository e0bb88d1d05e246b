"""Request and response shapes of /v1/embeddings, /v1/classify, /v1/score and /v1/rerank
(OpenAI's embeddings API and SGLang's others), and the pure functions between them and the
native `EmbeddingReqInput` and its results.

No I/O: `embedding_serving` drives the engine with these, and unit tests check them without
a model. Every user error is an `InvalidParameter` naming the field of the request at fault.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from typing import Any

import msgspec

from cadence.errors import InvalidParameter
from cadence.serving.body import parse_body

ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """POST /v1/embeddings (OpenAI's), with SGLang's rid."""

    input: Any  # str | list[str] | list[int] | list[list[int]], checked by `embedding_input`
    model: str | None = None  # the served model name; None means the served model
    encoding_format: str = "float"  # float (JSON numbers) or base64 (little-endian float32)
    dimensions: int | None = None  # Matryoshka truncation, where the model allows it
    user: str | None = None  # accepted, not used
    rid: str | list[str] | None = None  # request id(s), one per input for a batch
    lora_path: Any = None  # SGLang's field; refused: embeddings run on the base model only


class ClassifyRequest(msgspec.Struct, kw_only=True):
    """POST /v1/classify (SGLang's): class probabilities of each input."""

    input: Any  # str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    user: str | None = None
    rid: str | list[str] | None = None
    lora_path: Any = None  # refused: classification runs on the base model only


class ScoringRequest(msgspec.Struct, kw_only=True):
    """POST /v1/score (SGLang's): how likely each label token is right after query + item."""

    query: str | list[int] | None = None  # text, or token ids (then items are token ids too)
    items: Any = None  # str | list[str] | list[list[int]]
    label_token_ids: list[int] | None = None  # the tokens whose probabilities are scored
    apply_softmax: bool = False  # normalize over the labels instead of the whole vocabulary
    item_first: bool = False  # item + query instead of query + item
    model: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True):
    """POST /v1/rerank (SGLang's): documents ordered by relevance to the query."""

    query: str
    documents: list[str]
    instruct: str | None = None  # the task, for a generation model's yes/no prompt
    top_n: int | None = None  # return only the best n (default: all)
    return_documents: bool = True  # echo each document's text in its entry
    model: str | None = None


def parse(cls: type, body: bytes | str | dict) -> Any:
    """Decodes and type-checks a request body; unknown fields are ignored (as everywhere)."""
    required = {name: f"{name} is required{spec}" for name, spec in _required(cls)}
    return parse_body(cls, body, required)


def _required(cls: type) -> list[tuple[str, str]]:
    required = {
        EmbeddingRequest: [("input", ": a string, a list of strings or token id lists")],
        ClassifyRequest: [("input", ": a string or a list of strings")],
        RerankRequest: [("query", ""), ("documents", ": a list of strings")],
    }
    return required.get(cls, [])


# -- requests → native inputs ----------------------------------------------------------------


def embedding_input(value: Any, field: str = "input") -> dict[str, Any]:
    """OpenAI's `input` as EmbeddingReqInput fields: {"text": ...} or {"input_ids": ...}.
    Empty inputs and whitespace-only texts are refused (SGLang's checks)."""
    if isinstance(value, str):
        if not value.strip():
            raise InvalidParameter(field, f"{field} must not be empty or whitespace only")
        return {"text": value}
    if not isinstance(value, list) or not value:
        raise InvalidParameter(
            field,
            f"{field} must be a non-empty string, list of strings, list of token ids or "
            "list of token id lists",
        )
    if all(isinstance(v, str) for v in value):
        for i, text in enumerate(value):
            if not text.strip():
                raise InvalidParameter(field, f"{field}[{i}] must not be empty or whitespace only")
        return {"text": value}
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return {"input_ids": value}
    if all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidParameter(field, f"{field}[{i}] must be a non-empty list of token ids")
        return {"input_ids": value}
    raise InvalidParameter(
        field, f"{field} must be all strings, all token ids, or all lists of token ids (no mix)"
    )


def check_encoding_format(value: str) -> str:
    if value not in ENCODING_FORMATS:
        raise InvalidParameter(
            "encoding_format", f"encoding_format must be float or base64, got {value!r}"
        )
    return value


def score_prompts(query: Any, items: Any, item_first: bool) -> tuple[dict[str, Any], int]:
    """The prompts of a score request as GenerateReqInput fields ({"text": [...]} or
    {"input_ids": [...]}) and how many items there are. Texts are concatenated as they
    are (SGLang's rule), token ids likewise."""
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise InvalidParameter(
            "items", "items must be a non-empty list of strings or token id lists"
        )
    if isinstance(query, str):
        if not all(isinstance(i, str) for i in items):
            raise InvalidParameter("items", "items must be strings when the query is a string")
        texts = [item + query if item_first else query + item for item in items]
        return {"text": texts}, len(items)
    if isinstance(query, list) and all(isinstance(t, int) for t in query):
        if not all(isinstance(i, list) and all(isinstance(t, int) for t in i) for i in items):
            raise InvalidParameter(
                "items", "items must be token id lists when the query is token ids"
            )
        ids = [item + query if item_first else query + item for item in items]
        return {"input_ids": ids}, len(items)
    raise InvalidParameter("query", "query is required: a string or a list of token ids")


def check_labels(label_token_ids: Any, vocab_size: int) -> list[int]:
    if not label_token_ids:
        raise InvalidParameter(
            "label_token_ids",
            "label_token_ids is required: the token ids whose probabilities to score",
        )
    for t in label_token_ids:
        if not 0 <= t < vocab_size:
            raise InvalidParameter(
                "label_token_ids",
                f"label_token_ids: {t} is not a token of this model (vocabulary [0, {vocab_size}))",
            )
    return list(label_token_ids)


def label_scores(logprobs: list, labels: list[int], apply_softmax: bool) -> list[float]:
    """One item's score per label, from the logprobs of the label tokens at the next
    position ([logprob, id, text] entries): softmax over the labels, or each probability."""
    by_id = {entry[1]: entry[0] for entry in logprobs}
    values = [by_id.get(t, -math.inf) for t in labels]
    if not apply_softmax:
        return [math.exp(v) for v in values]
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


# -- results → responses ----------------------------------------------------------------------


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    data = array("f", vector)
    if sys.byteorder != "little":
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode()


def usage(prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}


def embedding_response(results: list[dict], model: str, encoding_format: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode_vector(r["embedding"], encoding_format),
            }
            for i, r in enumerate(results)
        ],
        "model": model,
        "usage": usage(sum(r["meta_info"].get("prompt_tokens", 0) for r in results)),
    }


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def with_label(result: dict, id2label: tuple[str, ...]) -> dict:
    """A classifier's result with its class probabilities and the most likely class."""
    probs = softmax(result["embedding"])
    best = max(range(len(probs)), key=probs.__getitem__)
    return {**result, "label": id2label[best], "probs": probs}


def classify_response(results: list[dict], model: str, rid: str, created: int) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {"index": i, "label": r["label"], "probs": r["probs"], "num_classes": len(r["probs"])}
            for i, r in enumerate(results)
        ],
        "usage": usage(sum(r["meta_info"].get("prompt_tokens", 0) for r in results)),
    }
