"""The front's embedding requests: checked and tokenized once for every adapter, sent to the
scheduler one request at a time, gathered by rid.

`EmbeddingChecker` is the one checking stage of an `EmbeddingReqInput` (as `RequestChecker`
is of a generation): the model must be an embedding model, the inputs few enough
(--max-embedding-batch), inside the vocabulary and the context, `dimensions` one the model
serves. `EmbeddingManager` is the embedding kind of the front's one `RequestBook` (which
holds the generations too, so rids are unique across both, and one budget, deadline and
abort serve every kind); it turns each item's vector into its result: {"embedding",
"meta_info"}.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from cadence.errors import InvalidParameter, RequestError
from cadence.front.engine_client import ModelInfo
from cadence.front.normalize import items, normalize_batch_and_arguments, one, one_or_none
from cadence.front.request_book import LiveRequest, RequestBook, RequestKind, until_finished
from cadence.front.request_checks import check_prompt_chars
from cadence.front.tokenizer import FrontTokenizer
from cadence.io_struct import (
    BatchEmbeddingOutput,
    BatchTokenizedEmbeddingReqInput,
    EmbeddingReqInput,
    TokenizedEmbeddingReqInput,
)

logger = logging.getLogger(__name__)


class EmbeddingChecker:
    def __init__(
        self,
        tokenizer: FrontTokenizer,
        info: ModelInfo,
        max_items: int,
        allow_auto_truncate: bool = False,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.max_items = max_items  # --max-embedding-batch
        self.allow_auto_truncate = allow_auto_truncate  # cut an input too long to embed

    async def check(
        self, obj: EmbeddingReqInput, worker_ipc: str | None
    ) -> list[TokenizedEmbeddingReqInput]:
        """Normalizes `obj` and returns its items tokenized and checked, in order. Raises
        InvalidParameter, naming the field, before anything is sent."""
        parts = self._check_request(obj)
        encoded = iter(await self._encode([item for item in parts if item.text is not None]))
        out = []
        for item in parts:
            types: list[int] | None
            if item.text is not None:
                ids, types = next(encoded)
                field_name = "text"
            else:
                ids, types = list(one(item.input_ids, list)), one_or_none(item.token_type_ids, list)
                field_name = "input_ids"
                self._check_ids(ids, types)
            ids, types = self._fit(field_name, ids, types)
            out.append(
                TokenizedEmbeddingReqInput(
                    rid=one(item.rid, str),
                    input_text=item.text if isinstance(item.text, str) else None,
                    input_ids=ids,
                    token_type_ids=types if types and any(types) else None,
                    http_worker_ipc=worker_ipc,
                )
            )
        return out

    def _check_request(self, obj: EmbeddingReqInput) -> list[EmbeddingReqInput]:
        """What can be checked before tokenizing; normalizes `obj` and returns its items."""
        self.check_embedding_model()
        if obj.is_cross_encoder_request and not self.info.type_vocab_size:
            raise InvalidParameter(
                "is_cross_encoder_request",
                "is_cross_encoder_request: text pairs need an encoder model (one with token "
                f"types); {self.info.served_model_name!r} is not one",
            )
        normalize_batch_and_arguments(obj)
        if obj.batch_size > self.max_items:
            raise InvalidParameter(
                "text" if obj.text is not None else "input_ids",
                f"the request has {obj.batch_size} inputs; this server takes at most "
                f"{self.max_items} per request (--max-embedding-batch)",
            )
        self.check_dimensions(obj.dimensions)
        parts = items(obj)
        for item in parts:
            if item.image_data is not None:
                raise InvalidParameter("image_data", "image_data: this model takes text only")
        return parts

    def check_embedding_model(self) -> None:
        info = self.info
        if info.is_generation:
            raise InvalidParameter(
                "model",
                f"the model {info.served_model_name!r} is a generation model: embeddings and "
                "classification need an embedding model (an encoder such as BERT, or a "
                "decoder served with --is-embedding); use /generate, /v1/completions or "
                "/v1/chat/completions with this one",
            )

    def check_dimensions(self, dimensions: int | None) -> None:
        info = self.info
        if dimensions is None or dimensions == info.embedding_dim:
            return
        allowed = info.matryoshka_dimensions
        if allowed is None or info.id2label:
            raise InvalidParameter(
                "dimensions",
                f"dimensions: the model {info.served_model_name!r} was not trained to serve "
                f"shorter embeddings (Matryoshka); leave dimensions out or give its own "
                f"size, {info.embedding_dim}",
            )
        if not 1 <= dimensions <= info.embedding_dim or (allowed and dimensions not in allowed):
            choices = ", ".join(map(str, allowed)) if allowed else f"1 to {info.embedding_dim}"
            raise InvalidParameter(
                "dimensions", f"dimensions must be one of {choices}, got {dimensions}"
            )

    async def _encode(self, parts: list[EmbeddingReqInput]) -> list[tuple[list[int], list[int]]]:
        texts = [_text_of(item) for item in parts]
        for text in texts:
            num_chars = len(text) if isinstance(text, str) else len(text[0]) + len(text[1])
            check_prompt_chars("text", num_chars, self.info, self.tokenizer)
        if not parts:
            return []
        return await self.tokenizer.encode_batch_async(texts)

    def _check_ids(self, ids: list[int], types: list[int] | None) -> None:
        vocab = self.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter(
                "input_ids", f"input_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        num_types = max(self.info.type_vocab_size, 1)
        if types and max(types) >= num_types:
            raise InvalidParameter(
                "token_type_ids",
                f"token_type_ids: {max(types)} is not a token type of this model "
                f"(it has {num_types})",
            )

    def _fit(
        self, field_name: str, ids: list[int], types: list[int] | None
    ) -> tuple[list[int], list[int] | None]:
        """The input's ids and token types if the model takes that many; otherwise a 400, or
        with --allow-auto-truncate their head that it takes."""
        limit = min(self.info.context_len, self.info.max_total_tokens)
        num = len(ids)
        if num == 0:
            raise InvalidParameter(
                field_name, f"{field_name}: the input is empty after tokenization"
            )
        if num > limit and self.allow_auto_truncate:
            logger.warning(
                "%s: the input has %d tokens, more than the model takes (%d); cut to its "
                "first %d (--allow-auto-truncate)", field_name, num, limit, limit,
            )  # fmt: skip
            return ids[:limit], None if types is None else types[:limit]
        if num > limit:
            raise InvalidParameter(
                field_name,
                f"{field_name}: the input has {num} tokens, more than the model takes "
                f"({limit}, its context length); shorten it",
            )
        return ids, types


def _text_of(item: EmbeddingReqInput) -> str | tuple[str, str]:
    """A normalized single input's text: a string, or a cross-encoder's [query, document]
    pair as one (query, document) tuple, encoded together as one sequence."""
    if isinstance(item.text, list):
        query, document = item.text
        return one(query, str), one(document, str)
    return one(item.text, str)


@dataclass(kw_only=True, eq=False)
class _EmbedState(LiveRequest):
    dimensions: int | None
    expired: bool = False  # ended by the server's deadline
    embedding: list[float] | None = None


class EmbeddingManager(RequestKind[_EmbedState]):
    """Embedding requests in flight in one front process: checked here, booked in the
    front's one `RequestBook` beside the generations."""

    def __init__(
        self,
        tokenizer: FrontTokenizer,
        info: ModelInfo,
        book: RequestBook,
        max_pending: int,
        max_items: int,
        allow_auto_truncate: bool = False,
    ):
        self.info = info
        self.book = book
        self.checker = EmbeddingChecker(tokenizer, info, max_items, allow_auto_truncate)
        # A request of the largest allowed batch always fits when nothing else is in flight.
        self.max_pending = max(max_pending, max_items)

    @property
    def states(self) -> dict[str, LiveRequest]:
        """The live embeddings by rid."""
        return self.book.of_kind(self)

    async def embed(self, obj: EmbeddingReqInput) -> dict | list[dict]:
        tokenized = await self.checker.check(obj, self.book.worker_ipc)
        self.book.check_rids([t.rid for t in tokenized])
        self.book.check_room(len(tokenized), self.max_pending)
        now = time.monotonic()
        states = [
            _EmbedState(rid=t.rid, kind=self, created=now, dimensions=obj.dimensions)
            for t in tokenized
        ]
        with self.book.hold(states):
            # One message for the whole request: the scheduler queues its items together.
            self.book.send(
                tokenized[0]
                if len(tokenized) == 1
                else BatchTokenizedEmbeddingReqInput(batch=tokenized)
            )
            for st in states:
                await until_finished(st)
            results = [self._result(st) for st in states]
        return results[0] if obj.is_single else results

    def _result(self, st: _EmbedState) -> dict:
        reason = st.meta.get("finish_reason") or {}
        if reason.get("type") == "abort":
            if st.expired:
                raise RequestError(504, self.book.deadline_message)
            message = reason.get("message", "aborted")
            status = reason.get("status_code") or 499
            raise RequestError(
                status,
                message if status != 499 else f"the request was aborted: {message}",
                param=reason.get("param"),
                is_request_fault=bool(reason.get("request_fault")),
            )
        vector = st.embedding  # None only for an aborted request, refused above
        if vector is not None and st.dimensions is not None and st.dimensions < len(vector):
            vector = vector[: st.dimensions]
            if self.info.normalizes:
                norm = math.sqrt(sum(x * x for x in vector)) or 1.0
                vector = [x / norm for x in vector]
        meta = {"id": st.rid, **st.meta, "e2e_latency": time.monotonic() - st.created}
        return {"embedding": vector, "meta_info": meta}

    # ---- the book's embedding kind (on the event loop) ---------------------------------------

    def take_output(self, st: _EmbedState, out: BatchEmbeddingOutput, i: int) -> bool:
        st.embedding = out.embeddings[i]
        st.meta.update(
            prompt_tokens=out.prompt_tokens[i],
            cached_tokens=out.cached_tokens[i],
            finish_reason=out.finished_reasons[i],
        )
        return True

    def on_deadline(self, st: _EmbedState) -> None:
        st.expired = True  # its consumer gets a 504, not the scheduler's abort
