"""The front's one checking stage: everything a request must pass before the scheduler sees it.

Shape and item count (`normalize`), sampling names, types and ranges (`sampling_checks`),
then what needs the model: token ids in the vocabulary, the prompt within the context and
the KV pool, the size of the logprobs asked for. Every failure is an `InvalidParameter`
naming the field; the scheduler trusts what passes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from cadence.constrained import InvalidGrammar, check_grammar, grammar_key
from cadence.errors import InvalidParameter
from cadence.front.engine_client import ModelInfo
from cadence.front.lora import LoRARegistry
from cadence.front.normalize import items, normalize_batch_and_arguments, one, one_or_none
from cadence.front.sampling_checks import (
    check_sampling_params,
    parse_sampling_params,
    preferred_sampling_params,
    with_preferred,
)
from cadence.front.tokenizer import FrontTokenizer
from cadence.io_struct import (
    FAKE_BOOTSTRAP_HOST,
    GenerateReqInput,
    SamplingParams,
    SessionParams,
    TokenizedGenerateReqInput,
)
from cadence.plugins import logit_processors

logger = logging.getLogger(__name__)

# Response size: a request may ask for at most this many logprob entries in all (top-k
# alternatives and given ids, per prompt and output position); each costs front CPU.
MAX_LOGPROB_ENTRIES = 1 << 20
MAX_TOP_LOGPROBS_NUM = 256  # top-k alternatives per position
# Constraints longer than this are checked on a worker thread, off the event loop.
OFF_LOOP_GRAMMAR_CHARS = 8192
# Prompts of one /tokenize request, id lists of one /detokenize request: each costs the
# event loop a few microseconds whatever its size, so their number is bounded too.
MAX_TOKENIZER_ITEMS = 4096


@dataclass(frozen=True)
class RequestOptions:
    """What the server lets a request ask for (its flags)."""

    enable_custom_logit_processor: bool = False
    enable_return_hidden_states: bool = False
    max_embedding_batch: int = 1024  # inputs of one embedding request (--max-embedding-batch)
    max_tokenize_chars: int = 4 << 20  # characters of one /tokenize request (--max-tokenize-chars)
    max_detokenize_tokens: int = 1 << 20  # ids of one /detokenize request (--max-detokenize-tokens)
    max_loaded_loras: int | None = None  # adapters one request may name (--max-loaded-loras)
    disaggregation_mode: str = "null"  # null, prefill or decode (--disaggregation-mode)
    disaggregation_bootstrap_port: int = 8998  # a decode request's default bootstrap_port
    decode_local_prefill: bool = False  # a decode server prefills roomless requests itself
    log_requests: bool = False  # log each generation request (--log-requests)
    log_requests_level: int = 2  # at this level of detail (--log-requests-level)
    allow_auto_truncate: bool = False  # cut an over-long prompt instead of refusing it
    # Sampling parameters a request leaves out take these (--preferred-sampling-params).
    preferred_sampling_params: dict[str, Any] | None = None

    @classmethod
    def of(cls, args) -> RequestOptions:
        """The options of a server's arguments (ServerArgs)."""
        return cls(
            enable_custom_logit_processor=args.enable_custom_logit_processor,
            enable_return_hidden_states=args.enable_return_hidden_states,
            max_embedding_batch=args.max_embedding_batch,
            max_tokenize_chars=args.max_tokenize_chars,
            max_detokenize_tokens=args.max_detokenize_tokens,
            max_loaded_loras=args.max_loaded_loras,
            disaggregation_mode=args.disaggregation_mode,
            disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
            decode_local_prefill=args.disaggregation_decode_local_prefill,
            log_requests=args.log_requests,
            log_requests_level=args.log_requests_level,
            allow_auto_truncate=args.allow_auto_truncate,
            preferred_sampling_params=preferred_sampling_params(args.preferred_sampling_params),
        )


def max_prompt_chars(info: ModelInfo, tokenizer: FrontTokenizer) -> int:
    """The most characters a prompt may have and still fit the context: no token is longer
    than the longest vocabulary entry (twice that, for a margin)."""
    return info.context_len * tokenizer.max_token_chars * 2


def check_prompt_chars(param: str, num_chars: int, info: ModelInfo, tokenizer) -> None:
    """Refuses, before it is rendered or tokenized, a prompt of `num_chars` characters too
    long to fit the context in any case."""
    if num_chars > max_prompt_chars(info, tokenizer):
        raise InvalidParameter(
            param,
            f"{param} has {num_chars} characters: far more tokens than the context "
            f"length ({info.context_len}) holds; shorten it",
        )


def check_message_count(param: str, num_messages: int, info: ModelInfo) -> None:
    """Refuses, before any message is looked at, a chat of more messages than the context
    holds tokens: each message renders to at least one token, so it cannot fit."""
    if num_messages > info.context_len:
        raise InvalidParameter(
            param,
            f"{param} has {num_messages} messages: more than the context length "
            f"({info.context_len}) holds tokens, so it cannot fit; send fewer",
        )


def check_tokenize_size(param: str, texts: list[str], max_chars: int) -> None:
    """Refuses, before anything is tokenized, more texts than MAX_TOKENIZER_ITEMS or more
    characters in all than `max_chars`: tokenizing costs memory and time in proportion."""
    if len(texts) > MAX_TOKENIZER_ITEMS:
        raise InvalidParameter(
            param,
            f"{param} has {len(texts)} prompts; at most {MAX_TOKENIZER_ITEMS} are tokenized "
            "in one request: send several requests",
        )
    check_tokenize_chars(param, sum(map(len, texts)), max_chars)


def check_tokenize_chars(param: str, num_chars: int, max_chars: int) -> None:
    if num_chars > max_chars:
        raise InvalidParameter(
            param,
            f"{param} has {num_chars} characters; this server tokenizes at most {max_chars} "
            "in one request (--max-tokenize-chars): split the text over several requests",
        )


def check_detokenize_size(param: str, id_lists: list, max_ids: int) -> None:
    """Refuses, before anything is decoded, more id lists than MAX_TOKENIZER_ITEMS or more
    ids in all than `max_ids`."""
    if len(id_lists) > MAX_TOKENIZER_ITEMS:
        raise InvalidParameter(
            param,
            f"{param} has {len(id_lists)} lists of ids; at most {MAX_TOKENIZER_ITEMS} are "
            "decoded in one request: send several requests",
        )
    num_ids = sum(map(len, id_lists))
    if num_ids > max_ids:
        raise InvalidParameter(
            param,
            f"{param} has {num_ids} token ids; this server decodes at most {max_ids} in one "
            "request (--max-detokenize-tokens): split them over several requests",
        )


def require_generation_model(info: ModelInfo) -> None:
    """An embedding model generates nothing: generation requests get a 400 naming `model`."""
    if not info.is_generation:
        raise InvalidParameter(
            "model",
            f"the model {info.served_model_name!r} is an embedding model: it generates "
            "nothing; use /v1/embeddings or /encode (/classify, /v1/rerank for a classifier)",
        )


class RequestChecker:
    def __init__(
        self,
        tokenizer: FrontTokenizer,
        info: ModelInfo,
        max_items: int,
        options: RequestOptions | None = None,
        lora: LoRARegistry | None = None,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.max_items = max_items  # requests the server holds at once: a bigger batch never fits
        self.options = options or RequestOptions()
        # The loaded adapters a request may name (by default only those loaded at start).
        self.lora = lora or LoRARegistry(
            info.lora_enabled, info.lora_adapters, max_loaded=self.options.max_loaded_loras
        )

    async def check_generate(
        self, obj: GenerateReqInput, worker_ipc: str | None
    ) -> list[TokenizedGenerateReqInput]:
        """Normalizes `obj` and returns its items tokenized and checked, in order. Raises
        InvalidParameter before anything is sent."""
        require_generation_model(self.info)
        self._check_prompt_sizes(obj)
        normalize_batch_and_arguments(obj, self.max_items)
        # The batch's adapters at once: one lookup at the scheduler for every name it lacks.
        lora_paths = obj.lora_path if isinstance(obj.lora_path, list) else [obj.lora_path]
        await self.lora.check(lora_paths, "lora_path")
        tokenized = [await self._check_item(item, worker_ipc) for item in items(obj)]
        if obj.parallel_sample_num > 1 and self.options.disaggregation_mode != "null":
            raise InvalidParameter(
                "n",
                "n > 1 is not served by a disaggregated server (one bootstrap room pairs one "
                "prefill with one decode); send n requests",
            )
        if obj.parallel_sample_num > 1:
            for j, t in enumerate(tokenized):
                if t.sampling_params.seed is not None:
                    # Samples of one prompt must differ, yet stay reproducible for a given seed.
                    t.sampling_params.seed += j % obj.parallel_sample_num
        return tokenized

    def _check_prompt_sizes(self, obj: GenerateReqInput) -> None:
        """Refuses a prompt that cannot fit the context from its length alone, before its
        items are looked at one by one (normalizing a 5M-id prompt took seconds)."""
        if isinstance(obj.text, str):
            self.check_text_length("text", obj.text)
        ids = obj.input_ids
        if isinstance(ids, list) and ids:
            if not isinstance(ids[0], list):
                obj.input_ids = self._fit_prompt("input_ids", ids)
            elif len(ids) <= self.max_items:  # a longer batch is refused by its size
                obj.input_ids = [
                    self._fit_prompt("input_ids", one) if isinstance(one, list) else one
                    for one in ids
                ]

    def check_text_length(self, param: str, text: str) -> None:
        """Refuses, before tokenizing it, a text too long to fit the context in any case."""
        check_prompt_chars(param, len(text), self.info, self.tokenizer)

    def check_token_ids(self, param: str, ids: list[int]) -> None:
        vocab = self.info.vocab_size
        if not ids or (min(ids) >= 0 and max(ids) < vocab):  # C loops: a long list is cheap
            return
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad and bad[0] < 0:
            raise InvalidParameter(param, f"{param}: token ids must be non-negative, got {bad[0]}")
        if bad:
            raise InvalidParameter(
                param, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )

    async def _check_item(
        self, item: GenerateReqInput, worker_ipc: str | None
    ) -> TokenizedGenerateReqInput:
        for name in ("image_data", "audio_data", "video_data"):
            if getattr(item, name) is not None:
                kind = name.split("_")[0]
                raise InvalidParameter(name, f"{name}: this model does not accept {kind} input")
        params = parse_sampling_params(
            with_preferred(item.sampling_params, self.options.preferred_sampling_params)
        )
        check_sampling_params(params, self.info.vocab_size)
        self._check_logprobs(item, params)
        await self._check_grammar(params)
        self._check_extras(item, params)
        input_ids = await self._input_ids(item)
        input_ids = self._check_length(item, input_ids, params)
        start_len = one(item.logprob_start_len, int)
        if item.return_logprob and start_len >= 0:
            if start_len >= len(input_ids):
                raise InvalidParameter(
                    "logprob_start_len",
                    f"logprob_start_len ({start_len}) must be below "
                    f"the prompt length ({len(input_ids)})",
                )
            self._check_logprob_entries(item, len(input_ids) - start_len + params.max_new_tokens)
        return TokenizedGenerateReqInput(
            rid=one(item.rid, str),
            input_text=one_or_none(item.text, str),
            input_ids=input_ids,
            sampling_params=params,
            return_logprob=bool(item.return_logprob),
            logprob_start_len=start_len,
            top_logprobs_num=self._top_logprobs_num(item),
            token_ids_logprob=one_or_none(item.token_ids_logprob, list),
            stream=item.stream,
            lora_path=one_or_none(item.lora_path, str),
            http_worker_ipc=worker_ipc,
            priority=item.priority,
            return_hidden_states=bool(item.return_hidden_states),
            custom_logit_processor=one_or_none(item.custom_logit_processor, str),
            session_params=(
                None
                if item.session_params is None
                else msgspec.convert(item.session_params, SessionParams)
            ),
            **self._bootstrap(item),
        )

    def _bootstrap(self, item: GenerateReqInput) -> dict[str, Any]:
        """The request's disaggregation fields. A prefill server needs the room, a decode
        server the room and the prefill host (the port defaults to its own
        --disaggregation-bootstrap-port, as SGLang's does), unless it prefills requests
        without a room itself (--disaggregation-decode-local-prefill); a server that runs
        both halves ignores them, as does every server for the health probe's fake host
        (SGLang's)."""
        mode = self.options.disaggregation_mode
        host = one_or_none(item.bootstrap_host, str)
        if mode == "null" or host == FAKE_BOOTSTRAP_HOST:
            return {}
        room = one_or_none(item.bootstrap_room, int)
        port = one_or_none(item.bootstrap_port, int)
        if mode == "decode" and self.options.decode_local_prefill and room is None and not host:
            return {}  # --disaggregation-decode-local-prefill: prefilled here, no transfer
        required = {"bootstrap_room": room} | ({"bootstrap_host": host} if mode == "decode" else {})
        for name, value in required.items():
            if value is None or value == "":
                local = (
                    " (a request without a room is prefilled on a decode server started with "
                    "--disaggregation-decode-local-prefill)"
                    if mode == "decode"
                    else ""
                )
                raise InvalidParameter(
                    name,
                    f"{name} is required: this server runs the {mode} half of prefill/decode "
                    "disaggregation; send requests through a PD router (cadence router "
                    "--pd-disaggregation), which sets bootstrap_host, bootstrap_port and "
                    f"bootstrap_room on both halves{local}",
                )
        if port is None:
            port = self.options.disaggregation_bootstrap_port
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}

    async def _check_grammar(self, params: SamplingParams) -> None:
        """A constraint the grammar engine refuses is a 400 naming the field, with the
        engine's reason; the scheduler only ever compiles constraints that passed here. The
        engine is the one the scheduler reported (none: constraints are refused)."""
        key = grammar_key(params)
        if key is None:
            return
        try:
            if len(key.text) > OFF_LOOP_GRAMMAR_CHARS:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, check_grammar, self.info.grammar_backend, key)
            else:
                check_grammar(self.info.grammar_backend, key)
        except InvalidGrammar as e:
            raise InvalidParameter(
                e.field, f"{e.field} is not a valid constraint: {e.reason}"
            ) from None

    def _check_extras(self, item: GenerateReqInput, params: SamplingParams) -> None:
        name = item.custom_logit_processor
        if name is not None:
            if not self.options.enable_custom_logit_processor:
                raise InvalidParameter(
                    "custom_logit_processor",
                    "custom_logit_processor needs the server flag --enable-custom-logit-processor",
                )
            if name not in logit_processors.names():
                known = ", ".join(sorted(logit_processors.names())) or "none is installed"
                raise InvalidParameter(
                    "custom_logit_processor",
                    f"custom_logit_processor names a processor registered by a plugin "
                    f"({known}); serialized code is never run. Got {name[:80]!r}",
                )
        elif params.custom_params is not None:
            raise InvalidParameter("custom_params", "custom_params needs a custom_logit_processor")
        if item.return_hidden_states and not self.options.enable_return_hidden_states:
            raise InvalidParameter(
                "return_hidden_states",
                "return_hidden_states needs the server flag --enable-return-hidden-states",
            )

    async def _input_ids(self, item: GenerateReqInput) -> list[int]:
        if item.text is not None:
            text = one(item.text, str)
            self.check_text_length("text", text)
            input_ids = await self.tokenizer.encode_async(text)
        else:
            input_ids = self._fit_prompt("input_ids", list(one(item.input_ids, list)))
            self.check_token_ids("input_ids", input_ids)  # after the cut: fewer to scan
        if not input_ids:
            raise InvalidParameter("text", "text: the prompt is empty after tokenization")
        return input_ids

    def _check_length(
        self, item: GenerateReqInput, input_ids: list[int], params: SamplingParams
    ) -> list[int]:
        """The prompt's ids, cut to fit with --allow-auto-truncate (its max_new_tokens then
        lowered to what is left); otherwise a prompt or a request that does not fit the
        context or the KV pool is refused."""
        input_ids = self._fit_prompt("text" if item.text is not None else "input_ids", input_ids)
        if self.options.allow_auto_truncate:
            self._fit_new_tokens(item, len(input_ids), params)
            return input_ids
        ctx, num = self.info.context_len, len(input_ids)
        if num + params.max_new_tokens > ctx:
            raise InvalidParameter(
                "max_new_tokens",
                f"max_new_tokens: the prompt ({num} tokens) plus max_new_tokens "
                f"({params.max_new_tokens}) exceeds the context length ({ctx}); lower it "
                f"to at most {ctx - num}",
            )
        if num + params.max_new_tokens > self.info.max_total_tokens:
            raise InvalidParameter(
                "max_new_tokens",
                f"max_new_tokens: the prompt ({num} tokens) plus max_new_tokens "
                f"({params.max_new_tokens}) needs more KV memory than the whole pool holds "
                f"({self.info.max_total_tokens} tokens); lower max_new_tokens",
            )
        return input_ids

    def _fit_prompt(self, param: str, input_ids: list[Any]) -> list[Any]:
        """`input_ids` if the prompt leaves the context room for a new token; otherwise a 400,
        or with --allow-auto-truncate its head that does (and fits the KV pool)."""
        ctx, num = self.info.context_len, len(input_ids)
        if self.options.allow_auto_truncate:
            keep = min(ctx, self.info.max_total_tokens) - 1
            if num > keep:
                logger.warning(
                    "%s: the prompt has %d tokens, more than the context (%d) or the KV pool "
                    "(%d) leaves room for; cut to its first %d (--allow-auto-truncate)",
                    param, num, ctx, self.info.max_total_tokens, keep,
                )  # fmt: skip
                return input_ids[:keep]
            return input_ids
        if num >= ctx:
            raise InvalidParameter(
                param,
                f"the prompt has {num} tokens, which is at least the context length ({ctx}); "
                "shorten it",
            )
        return input_ids

    def _fit_new_tokens(self, item: GenerateReqInput, num: int, params: SamplingParams) -> None:
        """--allow-auto-truncate: max_new_tokens (and min_new_tokens) lowered to what the
        context and the KV pool leave after a prompt of `num` tokens."""
        room = min(self.info.context_len, self.info.max_total_tokens) - num
        if params.max_new_tokens > room:
            logger.warning(
                "rid %s: max_new_tokens %d lowered to %d, what the context (%d) or the KV pool "
                "(%d) leaves after the prompt's %d tokens (--allow-auto-truncate)",
                item.rid, params.max_new_tokens, room, self.info.context_len,
                self.info.max_total_tokens, num,
            )  # fmt: skip
            params.max_new_tokens = room
            params.min_new_tokens = min(params.min_new_tokens, room)

    @staticmethod
    def _top_logprobs_num(item: GenerateReqInput) -> int:
        return one_or_none(item.top_logprobs_num, int) or 0

    @staticmethod
    def _token_ids_logprob(item: GenerateReqInput) -> list[int]:
        return one_or_none(item.token_ids_logprob, list) or []

    def _check_logprobs(self, item: GenerateReqInput, params: SamplingParams) -> None:
        top = self._top_logprobs_num(item)
        if top > min(MAX_TOP_LOGPROBS_NUM, self.info.vocab_size):
            raise InvalidParameter(
                "top_logprobs_num",
                f"top_logprobs_num must be at most "
                f"{min(MAX_TOP_LOGPROBS_NUM, self.info.vocab_size)}, got {top}",
            )
        self.check_token_ids("token_ids_logprob", self._token_ids_logprob(item))
        if item.return_logprob:
            self._check_logprob_entries(item, params.max_new_tokens)

    def _check_logprob_entries(self, item: GenerateReqInput, num_positions: int) -> None:
        per_position = 1 + self._top_logprobs_num(item) + len(self._token_ids_logprob(item))
        if num_positions * per_position > MAX_LOGPROB_ENTRIES:
            raise InvalidParameter(
                "top_logprobs_num",
                f"the logprobs asked for ({num_positions} positions x {per_position} entries) "
                f"exceed {MAX_LOGPROB_ENTRIES} entries per request; ask for fewer "
                "top_logprobs_num, token_ids_logprob or positions (logprob_start_len, "
                "max_new_tokens)",
            )
