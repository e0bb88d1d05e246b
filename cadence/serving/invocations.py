"""SageMaker's /invocations as vLLM serves it: one route that answers any body with the route
the body belongs to, by its shape. The answer (and the stream) is exactly that route's.

    messages              → chat completions
    prompt                → completions
    input                 → embeddings (classification, on a classification model)
    query and documents   → rerank
    query and items       → score

The first shape that matches wins, in this order, as in vLLM (which tries its request types
in the same order). A body that is not a JSON object goes to chat completions, whose parser
names what is wrong with it, as it did when /invocations was chat completions alone.
"""

from __future__ import annotations

import msgspec

from cadence.errors import InvalidParameter
from cadence.json_limits import TooDeep, check_depth
from cadence.serving.embedding_serving import EmbeddingServing
from cadence.serving.openai_results import OpenAIResult, error_response
from cadence.serving.openai_serving import OpenAIServing

_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])  # the top-level keys, values unread


class Invocations:
    """Dispatches /invocations bodies to the OpenAI-style routes (see the module doc)."""

    def __init__(self, openai: OpenAIServing, embeddings: EmbeddingServing):
        self.openai = openai
        self.embeddings = embeddings

    async def invoke(self, body: bytes) -> OpenAIResult:
        keys = _top_level_keys(body)
        if keys is None:
            return await self.openai.chat_completions(body)
        if "messages" in keys:
            return await self.openai.chat_completions(body)
        if "prompt" in keys:
            return await self.openai.completions(body)
        if "input" in keys:
            if self.openai.client.info.id2label:  # a classification model classifies
                return await self.embeddings.classify(body)
            return await self.embeddings.embeddings(body)
        if "query" in keys and "documents" in keys:
            return await self.embeddings.rerank(body)
        if "query" in keys and "items" in keys:
            return await self.embeddings.score(body)
        return error_response(
            InvalidParameter(
                None,
                "/invocations found no route for this body: send a chat completion "
                "(messages), a completion (prompt), embeddings or classification (input), "
                "a rerank (query and documents) or a score (query and items) request",
            )
        )


def _top_level_keys(body: bytes) -> set[str] | None:
    """The keys of a JSON object body, or None when the body is not one (nested too deep,
    not JSON, not an object): the chat route then says what is wrong with it."""
    try:
        check_depth(body)
        return set(_KEYS.decode(body))
    except (TooDeep, msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return None
