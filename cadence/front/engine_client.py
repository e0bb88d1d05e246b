"""The one interface the adapters speak to the engine through.

The HTTP adapter, the gRPC adapter and the in-process `Engine` hold an `EngineClient` and
nothing else of the engine: they never reach into the request book or a request's state.
`FrontClient` (front/client.py) implements it over the front's request book; the server's
front process and the in-process engine differ only in how messages travel.

Control calls are named methods (as vLLM's `EngineCoreClient` has them): each checks its
arguments (`front.control_checks`), builds the scheduler's message, sends it through
`control` and returns the typed answer, so the adapters only translate wire formats.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cadence.errors import InvalidParameter
from cadence.front.control_checks import (
    check_int_range,
    check_model_path,
    check_profile_name,
    check_session,
    check_weight_version,
)
from cadence.front.lora import LORA_NOT_ENABLED, LoRARegistry, check_load_args
from cadence.io_struct import (
    CloseSessionReqInput,
    ContinueGenerationReqInput,
    EmbeddingReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetLoadReqInput,
    GetLoadReqOutput,
    GetLoRAAdaptersReqInput,
    GetWeightVersionReqInput,
    LoadLoRAAdapterReqInput,
    LoRAAdapterInfo,
    LoRAUpdateOutput,
    OpenSessionReqInput,
    PauseGenerationReqInput,
    ProfileReq,
    ProfileReqOutput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightVersionReqInput,
    UpdateWeightVersionReqOutput,
    pause_mode,
)

# Seconds a weight update may take (reading a checkpoint from disk).
UPDATE_WEIGHTS_TIMEOUT_S = 900.0
FLUSH_RETRY_S = 0.1  # between the tries of a flush that waits for running requests
# Seconds a LoRA load may take (reading an adapter from disk; an unload waits for the
# requests that use the adapter only after answering).
LORA_LOAD_TIMEOUT_S = 300.0


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
    lora_enabled: bool = False  # --enable-lora: requests may name adapters
    # The adapters loaded at start (--lora-paths); the front's copy of the loaded set
    # (`EngineClient.lora`) follows loads and unloads from there.
    lora_adapters: tuple[LoRAAdapterInfo, ...] = ()

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
            lora_enabled=bool(facts.get("lora_enabled", False)),
            lora_adapters=tuple(
                msgspec.convert(facts.get("lora_adapters") or [], list[LoRAAdapterInfo])
            ),
        )

    @property
    def is_cross_encoder(self) -> bool:
        """A classification model: it scores text pairs (reranking) or classifies text."""
        return bool(self.id2label)


class EngineClient(ABC):
    """The engine as an adapter sees it. Errors are `cadence.errors` exceptions."""

    info: ModelInfo
    # The loaded LoRA adapters, as the scheduler last reported them (front/lora.py): the
    # client applies every LoRAUpdateOutput to it as the answer arrives.
    lora: LoRARegistry

    @property
    @abstractmethod
    def tokenizer(self):
        """The model's tokenizer (`FrontTokenizer`), for chat templates and token texts."""

    @abstractmethod
    def generate(self, obj: GenerateReqInput) -> AsyncGenerator[Any, None]:
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
        the scheduler; returns its answer when the message has one, else None. Raises
        RequestError 503 when no answer comes within `timeout` seconds. Adapters call the
        named methods below; this is their one way to the scheduler."""

    # ---- control, by name -------------------------------------------------------------------

    async def flush_cache(self, wait_s: float = 0.0) -> FlushCacheReqOutput:
        """Drops the prefix cache once no request runs: at once, or as soon as the running
        ones have ended within `wait_s` seconds. Not flushed: `success` False and why."""
        deadline = time.monotonic() + wait_s
        while True:
            out = await self.control(FlushCacheReqInput())
            remaining = deadline - time.monotonic()
            if out.success or remaining <= 0:
                return out
            await asyncio.sleep(min(FLUSH_RETRY_S, remaining))

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stops scheduling until `continue_generation`: abort ends the running requests,
        retract puts them back in the queue, in_place keeps them. InvalidParameter names
        `mode` when it is none of these."""
        await self.control(PauseGenerationReqInput(mode=pause_mode(mode)))

    async def continue_generation(self) -> None:
        await self.control(ContinueGenerationReqInput())

    async def get_load(
        self, dp_rank: int | None = None, timeout: float = 60.0
    ) -> list[GetLoadReqOutput]:
        """Each data-parallel rank's load (only rank `dp_rank`'s when given; none when no
        rank has that number)."""
        loads = [await self.control(GetLoadReqInput(), timeout=timeout)]
        return [load for load in loads if dp_rank is None or load.dp_rank == dp_rank]

    async def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        start_step: int | None = None,
    ) -> ProfileReqOutput:
        """Starts the torch profiler after `start_step` forward steps (at once by default);
        it stops by itself after `num_steps` steps when given. Traces go under the server's
        --profile-dir, in the subdirectory `output_dir` names (a plain name, never a path)."""
        check_int_range("num_steps", num_steps)
        check_int_range("start_step", start_step)
        check_profile_name(output_dir)
        return await self.control(
            ProfileReq(
                action="start", output_dir=output_dir, num_steps=num_steps, start_step=start_step
            )
        )

    async def stop_profile(self) -> ProfileReqOutput:
        return await self.control(ProfileReq(action="stop"))

    async def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> UpdateWeightFromDiskReqOutput:
        """Reloads the weights in place from a checkpoint of the same architecture; with
        `weight_version`, the new weights are served under that version."""
        check_model_path(model_path)
        if weight_version is not None:
            check_weight_version("weight_version", weight_version)
        return await self.control(
            UpdateWeightFromDiskReqInput(
                model_path=model_path, load_format=load_format, weight_version=weight_version
            ),
            timeout=UPDATE_WEIGHTS_TIMEOUT_S,
        )

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> UpdateWeightVersionReqOutput:
        """SGLang's /update_weight_version: the weights are served under `new_version` from
        now on (every live request aborted first, unless `abort_all_requests` is False)."""
        check_weight_version("new_version", new_version)
        return await self.control(
            UpdateWeightVersionReqInput(
                new_version=new_version, abort_all_requests=abort_all_requests
            )
        )

    async def get_weight_version(self) -> str:
        """The version of the weights served (--weight-version, or the last update's)."""
        reply = await self.control(GetWeightVersionReqInput())
        return reply.weight_version

    async def open_session(
        self,
        capacity_of_str_len: int = 0,
        session_id: str | None = None,
        streaming: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Opens a session (its requests continue each other, their KV kept pinned) and
        returns its id; InvalidParameter when it cannot be opened (its id is taken)."""
        check_int_range("capacity_of_str_len", capacity_of_str_len)
        check_session(session_id, timeout)
        out = await self.control(
            OpenSessionReqInput(
                capacity_of_str_len=capacity_of_str_len,
                session_id=session_id,
                streaming=streaming,
                timeout=timeout,
            )
        )
        if not out.success:
            raise InvalidParameter(None, f"cannot open the session: {out.message}")
        return out.session_id

    async def close_session(self, session_id: str) -> bool:
        """Closes a session, unpinning its KV; False when no such session was open."""
        return (await self.control(CloseSessionReqInput(session_id=session_id))).success

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, pinned: bool = False
    ) -> LoRAUpdateOutput:
        """Loads a PEFT adapter while serving; requests name it `lora_name` from then on.
        Not loaded (LoRA not enabled, the name taken, a bad adapter): `success` False and
        why. InvalidParameter for a missing name or path."""
        if not self.info.lora_enabled:
            return LoRAUpdateOutput(success=False, error_message=LORA_NOT_ENABLED)
        check_load_args(lora_name, lora_path, self._served_names())
        return await self.control(
            LoadLoRAAdapterReqInput(lora_name=lora_name, lora_path=lora_path, pinned=pinned),
            timeout=LORA_LOAD_TIMEOUT_S,
        )

    async def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        """Unloads an adapter: new requests may no longer name it; its memory is freed once
        the last request using it ends. Unknown name: `success` False and why."""
        if not self.info.lora_enabled:
            return LoRAUpdateOutput(success=False, error_message=LORA_NOT_ENABLED)
        if not isinstance(lora_name, str) or not lora_name:
            raise InvalidParameter("lora_name", "lora_name (a non-empty string) is required")
        return await self.control(UnloadLoRAAdapterReqInput(lora_name=lora_name))

    async def list_lora_adapters(self) -> list[LoRAAdapterInfo]:
        """The adapters loaded now, as the scheduler reports them (none without LoRA)."""
        if not self.info.lora_enabled:
            return []
        out = await self.control(GetLoRAAdaptersReqInput())
        return list(out.loaded_adapters)

    def _served_names(self) -> tuple[str, ...]:
        return self.info.served_model_names or (self.info.served_model_name,)

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
    def configure_logging(
        self, log_requests: bool | None = None, log_requests_level: int | None = None
    ) -> None:
        """SGLang's /configure_logging: turns --log-requests on or off and sets its level, for
        every front process; None leaves a setting as it is. ValueError for a bad level."""

    @abstractmethod
    def end_all(self, message: str, status: int = 503) -> None:
        """Ends every live request at once with an error of `status` (stopping, or the engine
        will never answer)."""
