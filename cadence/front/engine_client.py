"""The one interface the adapters speak to the engine through.

The HTTP adapter, the gRPC adapter and the in-process `Engine` hold an `EngineClient` and
nothing else of the engine: they never reach into the tokenizer manager or its per-request
state. `FrontClient` (front/client.py) implements it over the front's tokenizer manager; the
server's front process and the in-process engine differ only in how messages travel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cadence.io_struct import EmbeddingReqInput, GenerateReqInput


@dataclass(frozen=True)
class ModelInfo:
    """What the front knows about the loaded model (reported by the scheduler once loaded)."""

    model_path: str
    tokenizer_path: str | None
    served_model_name: str
    context_len: int
    vocab_size: int
    max_total_tokens: int
    is_generation: bool = True
    eos_token_ids: tuple[int, ...] = ()  # the model's and the tokenizer's end-of-sequence ids
    bos_token_id: int | None = None
    architecture: str = ""  # e.g. "llama"
    tokenizer_dir: str | None = None  # a local directory with tokenizer.json and its config
    # Every name the model answers to (--served-model-name a,b); the first is its id.
    served_model_names: tuple[str, ...] = ()
    # The grammar engine the scheduler enforces constraints with; "none": it enforces none,
    # so the front refuses them (cadence.constrained).
    grammar_backend: str = "none"
    # An embedding model (is_generation False): what its vectors are (docs/embeddings.md).
    embedding_dim: int = 0  # length of an embedding (a classifier's: its number of classes)
    pooling: str = ""  # cls, mean, max, mean_sqrt_len or last
    normalizes: bool = False  # embeddings come at unit length
    id2label: tuple[str, ...] = ()  # a classification model's class names, by index
    type_vocab_size: int = 0  # segment (token type) ids the model takes; 0: none
    # Prefix lengths the model was trained to serve (Matryoshka): None for none, () for any.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # Per tensor type in the model file: {"tensors": n, "served_as": "Q4_1" | "float32" | ...}.
    weight_types: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def from_facts(
        cls,
        model_path: str,
        tokenizer_path: str | None,
        served_model_names: list[str],
        tokenizer_dir: str | None,
        facts: dict,
    ) -> ModelInfo:
        """The front's view of a loaded model: its paths and names, and the facts the
        scheduler reported once the weights were in place (scheduler.process.runtime_facts)."""
        return cls(
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            served_model_name=served_model_names[0],
            context_len=facts["context_len"],
            vocab_size=facts["vocab_size"],
            max_total_tokens=facts["max_total_tokens"],
            eos_token_ids=tuple(facts.get("eos_token_ids", ())),
            bos_token_id=facts.get("bos_token_id"),
            architecture=facts.get("architecture", ""),
            tokenizer_dir=tokenizer_dir,
            served_model_names=tuple(served_model_names),
            grammar_backend=facts.get("grammar_backend", "none"),
            is_generation=facts.get("is_generation", True),
            embedding_dim=facts.get("embedding_dim", 0),
            pooling=facts.get("pooling", ""),
            normalizes=facts.get("normalizes", False),
            id2label=tuple(facts.get("id2label") or ()),
            type_vocab_size=facts.get("type_vocab_size", 0),
            matryoshka_dimensions=(
                None
                if facts.get("matryoshka_dimensions") is None
                else tuple(facts["matryoshka_dimensions"])
            ),
            weight_types=dict(facts.get("weight_types") or {}),
        )

    @property
    def is_cross_encoder(self) -> bool:
        """A classification model: it scores text pairs (reranking) or classifies text."""
        return bool(self.id2label)


class EngineClient(ABC):
    """The engine as an adapter sees it. Errors are `cadence.errors` exceptions."""

    info: ModelInfo

    @property
    @abstractmethod
    def tokenizer(self):
        """The model's tokenizer (`FrontTokenizer`), for chat templates and token texts."""

    @abstractmethod
    def generate(self, obj: GenerateReqInput) -> AsyncIterator[Any]:
        """Checks, tokenizes and runs `obj`. Yields one final result (a dict, or a list for a
        batch), or with `obj.stream` the delta chunks (dicts; an `index` for batches).
        Closing the iterator early aborts what still runs."""

    @abstractmethod
    async def embed(self, obj: EmbeddingReqInput) -> Any:
        """Checks, tokenizes and runs `obj` on an embedding model: one result dict
        {"embedding", "meta_info"} (a list of them for a batch). Raises InvalidParameter
        (also for a generation model) or RequestError; cancelling aborts what still runs."""

    @abstractmethod
    def abort(
        self, rid: str | None = None, abort_all: bool = False, message: str = "aborted"
    ) -> bool:
        """Ends request `rid` (and its n > 1 samples `rid-j`), or every request; True when a
        live request was hit."""

    @abstractmethod
    async def tokenize(
        self, text: str, add_special_tokens: bool = True, prompt_field: str | None = None
    ) -> list[int]:
        """The token ids of `text`. With `prompt_field` (the request field it came from) the
        text is a prompt: one that cannot fit the context is refused before tokenizing."""

    @abstractmethod
    async def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids; raises InvalidParameter for ids outside the vocabulary."""

    @abstractmethod
    async def tokenize_batch(
        self, texts: list[str], add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[list[int]]:
        """The token ids of each text (/tokenize, gRPC Tokenize): more texts or characters
        than the server tokenizes in one request are refused, naming `param`, first."""

    @abstractmethod
    async def detokenize_batch(
        self, id_lists: list, skip_special_tokens: bool = True, param: str = "tokens"
    ) -> list[str]:
        """The text of each list of token ids (/detokenize, gRPC Detokenize): more lists or
        ids than the server decodes in one request, ids that are not integers or are
        outside the vocabulary are refused, naming `param`, first."""

    @abstractmethod
    async def control(self, msg, timeout: float = 60.0):
        """Sends a control message (flush, pause, continue, load, profile, weight update) to
        the scheduler; returns its answer when the message has one, else None."""

    @property
    @abstractmethod
    def is_paused(self) -> bool:
        """Generation was paused through this client and not continued yet."""

    @abstractmethod
    def backlog(self, rids: list[str], consumed: int) -> int:
        """Tokens these requests produced beyond the `consumed` ones (0 once they ended)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for /metrics (requests that ended in an internal error of their own, ...)."""

    @abstractmethod
    def end_all(self, message: str, status: int = 503) -> None:
        """Ends every live request at once with an error of `status` (stopping, or the engine
        will never answer)."""
