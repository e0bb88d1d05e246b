"""Embeddings, classification, scoring and reranking, once for every adapter.

The functions take the front's `EngineClient` and parsed arguments: the HTTP routes, the gRPC
RPCs (TextEmbed, Embed, Classify and the OpenAI pass-through ones) and the in-process
`Engine` all call them, so the three answer alike. `EmbeddingServing` wraps them for raw
JSON bodies, answering `OpenAIResponse`s as `OpenAIServing` does.

- encode / classify: an embedding model's vectors (a classifier's class logits, with the
  label and class probabilities added).
- score (SGLang's /v1/score): a generation model's probability of each label token right
  after query + item: one prefill per item, and the label tokens' logprobs at its end.
- rerank: a cross-encoder's relevance (the sigmoid of its one logit, as sentence-transformers'
  CrossEncoder), an embedding model's cosine similarity, or a generation model's
  probability of "yes" over "no" when asked whether the document meets the query.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Any

import msgspec

from cadence.errors import InvalidParameter, RequestError
from cadence.front.engine_client import EngineClient
from cadence.io_struct import EmbeddingReqInput, GenerateReqInput
from cadence.serving import embedding_protocol as proto
from cadence.serving.body import parse_struct
from cadence.serving.errors import request_fault
from cadence.serving.native_api import last_result
from cadence.serving.openai_results import OpenAIResponse, error_response
from cadence.serving.openai_serving import OpenAIServing

logger = logging.getLogger(__name__)

# The yes/no judgement a generation model is asked for each document (Qwen3-Reranker's).
RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"


# -- the operations --------------------------------------------------------------------------


async def encode(client: EngineClient, obj: EmbeddingReqInput) -> dict | list[dict]:
    """/encode, TextEmbed, Embed: {"embedding", "meta_info"} per input."""
    return await client.embed(obj)


async def classify(client: EngineClient, obj: EmbeddingReqInput) -> dict | list[dict]:
    """/classify, Classify: the class logits as `embedding`, and for a classification model
    its `label` (the most likely class) and `probs` (softmax of the logits)."""
    results = await client.embed(obj)
    labels = client.info.id2label
    if not labels:
        return results
    if isinstance(results, list):
        return [proto.with_label(r, labels) for r in results]
    return proto.with_label(results, labels)


def check_classifier(client: EngineClient) -> None:
    info = client.info
    if not info.id2label:
        raise InvalidParameter(
            "model",
            f"the model {info.served_model_name!r} is not a classification model (no "
            "id2label); /v1/classify needs one, e.g. a BertForSequenceClassification",
        )


async def score(
    client: EngineClient,
    query: Any,
    items: Any,
    label_token_ids: Any,
    apply_softmax: bool = False,
    item_first: bool = False,
    max_items: int | None = None,
) -> dict[str, Any]:
    """{"scores": [[score per label] per item], "usage"} (see the module docstring)."""
    info = client.info
    if not info.is_generation:
        raise InvalidParameter(
            "model",
            f"the model {info.served_model_name!r} is an embedding model: /v1/score reads a "
            "generation model's next-token probabilities; use /v1/rerank or /v1/embeddings",
        )
    labels = proto.check_labels(label_token_ids, info.vocab_size)
    prompts, num = proto.score_prompts(query, items, item_first)
    _check_count("items", num, max_items)
    scores, prompt_tokens = await _label_scores(client, prompts, labels, apply_softmax)
    return {"scores": scores, "usage": proto.usage(prompt_tokens)}


async def rerank(
    client: EngineClient,
    query: Any,
    documents: Any,
    top_n: int | None = None,
    return_documents: bool = True,
    instruct: str | None = None,
    max_items: int | None = None,
) -> list[dict[str, Any]]:
    """[{"score", "index", "document"?, "meta_info"}] best first (SGLang's shape), at most
    `top_n` of them."""
    if not isinstance(query, str) or not query.strip():
        raise InvalidParameter("query", "query must be a non-empty string")
    if not isinstance(documents, list) or not documents:
        raise InvalidParameter("documents", "documents must be a non-empty list of strings")
    for i, doc in enumerate(documents):
        if not isinstance(doc, str) or not doc.strip():
            raise InvalidParameter("documents", f"documents[{i}] must be a non-empty string")
    if top_n is not None and (not isinstance(top_n, int) or top_n < 1):
        raise InvalidParameter("top_n", f"top_n must be an integer >= 1, got {top_n!r}")
    _check_count("documents", len(documents), max_items)
    info = client.info
    if info.is_generation:
        scores, metas = await _yes_no_scores(client, query, documents, instruct)
    elif info.is_cross_encoder:
        scores, metas = await _cross_encoder_scores(client, query, documents)
    else:
        scores, metas = await _cosine_scores(client, query, documents)
    entries = [
        {"score": s, "index": i, "meta_info": m} for i, (s, m) in enumerate(zip(scores, metas))
    ]
    if return_documents:
        for entry in entries:
            entry["document"] = documents[entry["index"]]
    entries.sort(key=lambda e: e["score"], reverse=True)
    return entries[:top_n] if top_n is not None else entries


def _check_count(field: str, num: int, max_items: int | None) -> None:
    if max_items is not None and num > max_items:
        raise InvalidParameter(
            field,
            f"{field} has {num} entries; this server takes at most {max_items} per request "
            "(--max-embedding-batch)",
        )


async def _label_scores(
    client: EngineClient, prompts: dict[str, Any], labels: list[int], apply_softmax: bool
) -> tuple[list[list[float]], int]:
    """Each prompt's label scores (one greedy token, with the labels' logprobs at it)."""
    obj = GenerateReqInput(
        **prompts,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        token_ids_logprob=labels,
    )
    results = await last_result(client.generate(obj))
    results = results if isinstance(results, list) else [results]
    scores = [
        proto.label_scores(r["meta_info"]["output_token_ids_logprobs"][0], labels, apply_softmax)
        for r in results
    ]
    return scores, sum(r["meta_info"]["prompt_tokens"] for r in results)


async def _yes_no_scores(client: EngineClient, query: str, documents: list[str], instruct):
    yes = await client.tokenize("yes", add_special_tokens=False)
    no = await client.tokenize("no", add_special_tokens=False)
    if len(yes) != 1 or len(no) != 1:
        raise InvalidParameter(
            "model", "this generation model has no single-token 'yes' and 'no' to score with"
        )
    prompts = []
    for doc in documents:
        text = _judgement_prompt(client, query, doc, instruct or DEFAULT_INSTRUCT)
        prompts.append(
            await client.tokenize(text, add_special_tokens=False, prompt_field="documents")
        )
    scores, _ = await _label_scores(client, {"input_ids": prompts}, [yes[0], no[0]], True)
    return [s[0] for s in scores], [{"prompt_tokens": len(p)} for p in prompts]


def _judgement_prompt(client: EngineClient, query: str, doc: str, instruct: str) -> str:
    messages = [
        {"role": "system", "content": RERANK_SYSTEM},
        {
            "role": "user",
            "content": f"<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {doc}",
        },
    ]
    try:
        return client.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a tokenizer without a chat template: the plain conversation
        return f"{RERANK_SYSTEM}\n{messages[1]['content']}\nAnswer:"


async def _cross_encoder_scores(client: EngineClient, query: str, documents: list[str]):
    labels = client.info.id2label
    if len(labels) != 1:
        raise InvalidParameter(
            "model",
            f"reranking with a classifier needs one output (num_labels 1); "
            f"{client.info.served_model_name!r} has {len(labels)} classes: use /v1/classify",
        )
    obj = EmbeddingReqInput(text=[[query, doc] for doc in documents], is_cross_encoder_request=True)
    results = await client.embed(obj)
    scores = [1.0 / (1.0 + math.exp(-r["embedding"][0])) for r in results]
    return scores, [_meta(r) for r in results]


async def _cosine_scores(client: EngineClient, query: str, documents: list[str]):
    # The query goes on its own: --max-embedding-batch counts documents, so a request of
    # exactly that many must fit (one after the other, the two never exceed it together).
    q = (await client.embed(EmbeddingReqInput(text=[query])))[0]["embedding"]
    results = await client.embed(EmbeddingReqInput(text=documents))
    q_norm = math.sqrt(sum(x * x for x in q)) or 1.0
    scores = []
    for r in results:
        d = r["embedding"]
        d_norm = math.sqrt(sum(x * x for x in d)) or 1.0
        scores.append(max(-1.0, min(1.0, sum(a * b for a, b in zip(q, d)) / (q_norm * d_norm))))
    return scores, [_meta(r) for r in results]


def _meta(result: dict) -> dict[str, Any]:
    meta = result["meta_info"]
    return {k: meta[k] for k in ("id", "prompt_tokens", "e2e_latency") if k in meta}


# -- raw JSON bodies (HTTP routes and the gRPC pass-through RPCs) -----------------------------

_INPUT_NAMES = {"text": "input", "input_ids": "input"}


class EmbeddingServing:
    """The OpenAI-style routes of this module over raw JSON bodies: `OpenAIResponse`s with
    the HTTP status, errors as OpenAI error bodies naming the request's own fields."""

    def __init__(self, state, openai: OpenAIServing):
        self.state = state
        self.openai = openai  # for --strict-model-name

    @property
    def client(self) -> EngineClient:
        return self.state.client

    @property
    def max_items(self) -> int:
        return self.state.args.max_embedding_batch

    def _model(self, name: str | None, lora_path: Any = None, what: str = "embeddings") -> str:
        self.openai.refuse_lora(name, lora_path, what)
        return name or self.client.info.served_model_name

    async def embeddings(self, body: bytes) -> OpenAIResponse:
        async def run():
            req = proto.parse(proto.EmbeddingRequest, body)
            model = self._model(req.model, req.lora_path)
            fmt = proto.check_encoding_format(req.encoding_format)
            obj = EmbeddingReqInput(
                **proto.embedding_input(req.input), rid=req.rid, dimensions=req.dimensions
            )
            results = await encode(self.client, obj)
            results = results if isinstance(results, list) else [results]
            return proto.embedding_response(results, model, fmt)

        return await _answer(run, _INPUT_NAMES)

    async def classify(self, body: bytes) -> OpenAIResponse:
        async def run():
            req = proto.parse(proto.ClassifyRequest, body)
            model = self._model(req.model, req.lora_path, "classifications")
            check_classifier(self.client)
            obj = EmbeddingReqInput(**proto.embedding_input(req.input), rid=req.rid)
            results = await classify(self.client, obj)
            results = results if isinstance(results, list) else [results]
            rid = f"classify-{uuid.uuid4().hex}"
            return proto.classify_response(results, model, rid, int(time.time()))

        return await _answer(run, _INPUT_NAMES)

    async def score(self, body: bytes) -> OpenAIResponse:
        async def run():
            req = proto.parse(proto.ScoringRequest, body)
            model = self._model(req.model, what="scores")
            out = await score(
                self.client,
                req.query,
                req.items,
                req.label_token_ids,
                req.apply_softmax,
                req.item_first,
                self.max_items,
            )
            return {**out, "model": model, "object": "scoring"}

        return await _answer(run, {"text": "items", "input_ids": "items"})

    async def rerank(self, body: bytes) -> OpenAIResponse:
        async def run():
            req = proto.parse(proto.RerankRequest, body)
            self._model(req.model, what="rerankings")
            return await rerank(
                self.client,
                req.query,
                req.documents,
                req.top_n,
                req.return_documents,
                req.instruct,
                self.max_items,
            )

        return await _answer(run, {"text": "documents", "input_ids": "documents"})


async def _answer(run, names: dict[str, str]) -> OpenAIResponse:
    try:
        return OpenAIResponse(200, msgspec.json.encode(await run()))
    except (InvalidParameter, RequestError) as e:
        return error_response(e, names)
    except Exception as e:
        logger.exception("embedding request failed")
        return error_response(request_fault("serving the request", e), names)


def encode_input(body: Any) -> EmbeddingReqInput:
    """The /encode (and /classify) body (decoded) as a request struct, not yet normalized;
    InvalidParameter names a field of the wrong type. SGLang's `lora_path` is refused
    (embeddings run on the base model only) rather than ignored."""
    if isinstance(body, dict) and body.get("lora_path") is not None:
        raise InvalidParameter(
            "lora_path",
            "lora_path: embeddings and classifications run on the base model only; LoRA "
            "adapters serve generation (/generate, /v1/chat/completions, /v1/completions)",
        )
    return parse_struct(EmbeddingReqInput, body)
