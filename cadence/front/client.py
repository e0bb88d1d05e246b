"""`FrontClient`: the `EngineClient` over the front's request book and its request kinds.

Messages to the scheduler go through a `send` callable; whatever comes back (text outputs,
control answers) is handed to `on_message` on the client's event loop. The front process
wires those to ZMQ sockets (`front/ipc_client.py`), the in-process `Engine` to its
scheduler thread; everything else is the same code.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from cadence.errors import CadenceError, InvalidParameter, RequestError
from cadence.front.embedding import EmbeddingManager
from cadence.front.engine_client import EngineClient, ModelInfo
from cadence.front.lora import LoRARegistry
from cadence.front.request_book import RequestBook
from cadence.front.request_checks import (
    RequestOptions,
    check_detokenize_size,
    check_tokenize_size,
)
from cadence.front.tokenizer import FrontTokenizer
from cadence.front.tokenizer_manager import TokenizerManager
from cadence.io_struct import (
    REPLY_TYPES,
    BatchEmbeddingOutput,
    BatchStrOutput,
    ContinueGenerationReqInput,
    EmbeddingReqInput,
    GenerateReqInput,
    LoRAUpdateOutput,
    PauseGenerationReqInput,
)

logger = logging.getLogger(__name__)


class FrontClient(EngineClient):
    def __init__(
        self,
        tokenizer: FrontTokenizer,
        info: ModelInfo,
        send: Callable[[Any], None],
        max_pending: int,
        address: str | None = None,
        request_timeout_s: float | None = None,
        options: RequestOptions | None = None,
    ):
        self.info = info
        self.options = options or RequestOptions()
        self.address = address  # where answers for this client go (its `http_worker_ipc`)
        self._send = send
        # The loaded LoRA adapters; a name it lacks is looked up at the scheduler.
        self.lora = LoRARegistry(
            info.lora_enabled,
            info.lora_adapters,
            refresh=self.list_lora_adapters,
            max_loaded=self.options.max_loaded_loras,
        )
        # Every request in flight, of every kind: one rid registry, budget, deadline and abort.
        self.book = RequestBook(self.send, worker_ipc=address, request_timeout_s=request_timeout_s)
        self.tm = TokenizerManager(
            tokenizer, info, self.book, max_pending, self.options, lora=self.lora
        )
        options = self.options
        self.embeds = EmbeddingManager(tokenizer, info, self.book, max_pending,
                                       options.max_embedding_batch, options.allow_auto_truncate)  # fmt: skip
        # The callers waiting for a control answer, by the id (`cid`) their request carried:
        # an answer finds its own caller whatever the order answers come in, and a request
        # that never left takes no one's answer.
        self._control_waiters: dict[str, asyncio.Future] = {}
        self._is_paused = False
        # With several front processes (--api-workers), a flag in shared memory: a pause
        # through one front holds new generations on every front.
        self.shared_pause = None
        self.is_closed = False

    @property
    def tokenizer(self) -> FrontTokenizer:
        return self.tm.tokenizer

    def send(self, msg) -> None:
        if self.is_closed:  # shutting down: a late abort from a request's cleanup has nowhere to go
            return
        self._send(msg)

    def on_message(self, msg) -> None:
        """Something from the scheduler side arrived (called on this client's event loop)."""
        if isinstance(msg, BatchStrOutput | BatchEmbeddingOutput):
            self.book.on_output(msg)
            return
        if isinstance(msg, LoRAUpdateOutput):  # in the scheduler's order, waited for or not
            self.lora.update(msg)
        fut = self._control_waiters.pop(getattr(msg, "cid", None) or "", None)
        if fut is None:  # its caller gave up (timed out, disconnected) before it came
            logger.warning("a %s no caller waits for any more", type(msg).__name__)
        elif not fut.done():
            fut.set_result(msg)

    # ---- EngineClient -------------------------------------------------------------------------

    def generate(self, obj: GenerateReqInput) -> AsyncGenerator[Any, None]:
        return self.tm.generate_request(obj)

    async def embed(self, obj: EmbeddingReqInput) -> Any:
        return await self.embeds.embed(obj)

    def abort(
        self, rid: str | None = None, abort_all: bool = False, message: str = "aborted"
    ) -> bool:
        if abort_all:
            self.book.abort_all(message)
            return True
        if not isinstance(rid, str) or not rid:
            raise InvalidParameter("rid", "give a rid (string) or abort_all: true")
        matching = self.book.matching(rid)
        for r in matching or [rid]:  # not live here: it may still be queued in the scheduler
            self.book.abort(r, message)
        return bool(matching)

    async def tokenize(
        self, text: str, add_special_tokens: bool = True, prompt_field: str | None = None
    ) -> list[int]:
        if prompt_field is not None:
            self.tm.checker.check_text_length(prompt_field, text)
        return await self.tm.tokenizer.encode_async(text, add_special_tokens)

    async def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.tm.checker.check_token_ids("tokens", ids)
        return await self.tm.tokenizer.decode_async(ids, skip_special_tokens)

    async def tokenize_batch(
        self, texts: list[str], add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[list[int]]:
        check_tokenize_size(param, texts, self.options.max_tokenize_chars)
        return await self.tm.tokenizer.encode_many_async(texts, add_special_tokens)

    async def detokenize_batch(
        self, id_lists: list, skip_special_tokens: bool = True, param: str = "tokens"
    ) -> list[str]:
        check_detokenize_size(param, id_lists, self.options.max_detokenize_tokens)
        checked = []
        for ids in id_lists:
            if not isinstance(ids, list | tuple):  # a protobuf repeated field
                ids = list(ids)
            try:  # one C pass over each list: ints only (not bools, floats or strings)
                ids = msgspec.convert(ids, list[int], strict=True)
            except msgspec.ValidationError:
                raise InvalidParameter(
                    param, f"{param} must be a list of token ids or a list of such lists"
                ) from None
            self.tm.checker.check_token_ids(param, ids)
            checked.append(ids)
        return await self.tm.tokenizer.decode_many_async(checked, skip_special_tokens)

    async def control(self, msg, timeout: float = 60.0):
        msg.http_worker_ipc = self.address
        if isinstance(msg, PauseGenerationReqInput | ContinueGenerationReqInput):
            self._is_paused = isinstance(msg, PauseGenerationReqInput)
            if self.shared_pause is not None:
                self.shared_pause.value = self._is_paused
        if type(msg) not in REPLY_TYPES:
            self._send_control(msg)
            return None
        msg.cid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters[msg.cid] = fut
        try:
            self._send_control(msg)
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise RequestError(
                503, f"the scheduler did not answer {type(msg).__name__} in {timeout:.0f}s"
            ) from None
        finally:  # answered, failed to send, timed out or cancelled: no waiter stays behind
            self._control_waiters.pop(msg.cid, None)

    def _send_control(self, msg) -> None:
        """Sends a control message; one that cannot be sent fails its caller at once."""
        try:
            self.send(msg)
        except CadenceError:
            raise
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
            # A value the codec cannot carry (the edge checks should have refused it first):
            # this request's fault, and the server is unharmed.
            raise RequestError(
                500,
                f"{type(msg).__name__} could not be sent to the scheduler: {type(e).__name__}: {e}",
                is_request_fault=True,
            ) from e

    def configure_logging(
        self, log_requests: bool | None = None, log_requests_level: int | None = None
    ) -> None:
        self.tm.log.configure(log_requests, log_requests_level)

    @property
    def is_paused(self) -> bool:
        if self.shared_pause is not None:
            return bool(self.shared_pause.value)
        return self._is_paused

    def backlog(self, rids: list[str], consumed: int) -> int:
        return self.tm.backlog(rids, consumed)

    def stats(self) -> dict[str, Any]:
        return {
            "request_faults": dict(self.book.num_request_faults),
            "num_live_requests": len(self.book),
        }

    def end_all(self, message: str, status: int = 503) -> None:
        self.book.end_all(message, status)
        waiters, self._control_waiters = self._control_waiters, {}
        for fut in waiters.values():  # the scheduler will not answer them either
            if not fut.done():
                fut.set_exception(RequestError(status, message))
