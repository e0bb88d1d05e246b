"""The front process's engine client: validate, tokenize, send, and gather results by rid.

Both protocol adapters (HTTP, gRPC) and the in-process `Engine` go through one
`TokenizerManager`, so validation and results can never drift apart. It talks to the
scheduler through a `send` callable and receives `BatchStrOutput`s via `handle_output`;
whether those travel over ZMQ or stay in one process is the caller's business.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import logging

from cadence import hooks
from cadence.io_struct import AbortReq, BatchStrOutput, GenerateReqInput, Logprobs, TokenizedGenerateReqInput
from cadence.sampling_params import InvalidParameter, SamplingParams


logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server will not or cannot serve; `status` is the HTTP status to answer.

    `is_request_fault` marks an internal error (5xx) caused by the request itself, which
    the server survived: retrying it elsewhere would fail the same way."""

    def __init__(self, status: int, message: str, param: str | None = None, is_request_fault: bool = False):
        super().__init__(message)
        self.status = status
        self.param = param
        self.is_request_fault = is_request_fault


# Response size: a request may ask for at most this many logprob entries in all (top-k
# alternatives and given ids, per prompt and output position); each costs front CPU.
MAX_LOGPROB_ENTRIES = 1 << 20
MAX_TOP_LOGPROBS_NUM = 256  # top-k alternatives per position
# Texts longer than this are tokenized on a worker thread (the tokenizer's batch call
# releases the GIL), so a large prompt never stalls the event loop for other clients.
OFF_LOOP_TOKENIZE_CHARS = 16384


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


@dataclass
class _ReqState:
    obj: GenerateReqInput  # the single item
    created: float
    chunks: list[tuple[str, list[int]]] = field(default_factory=list)  # (text, ids) deltas not yet yielded
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    logprobs_sent: dict[str, int] = field(default_factory=dict)  # stream: entries already yielded


_LP_FIELDS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
              "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class TokenizerManager:
    def __init__(self, tokenizer, info: ModelInfo, send: Callable[[Any], None],
                 max_pending: int = 1088, worker_ipc: str | None = None, request_timeout_s: float | None = None):
        self.tokenizer = tokenizer
        # A fast (Rust) Hugging Face tokenizer encodes through its `tokenizers` backend: the
        # same ids without the Python wrapping around it (several times the cost of the
        # encoding itself for a short prompt).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_encode = backend.encode if backend is not None else None
        self.info = info
        self.send = send
        self.max_pending = max_pending
        self.worker_ipc = worker_ipc
        self.request_timeout_s = request_timeout_s
        self.states: dict[str, _ReqState] = {}
        # No token is longer than the longest vocabulary entry (a byte-level or
        # sentencepiece key has at least one character per decoded character), so a text
        # longer than context_len times that (with a margin) can never fit: refused before
        # it is tokenized.
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_token_chars = max((len(k) for k in vocab), default=64)
        self._token_texts: dict[int, str] = {}  # id -> decoded text, for logprobs with text
        # Requests that ended in an internal error of their own, by where it happened.
        self.num_request_faults: dict[str, int] = {"scheduler": 0, "detokenizer": 0, "front": 0}

    # ---- validation and tokenization (no scheduler involved) ------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`, as `tokenizer.encode` gives them."""
        if self._backend_encode is not None:
            return self._backend_encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, on a worker thread for a long text (the event loop keeps serving)."""
        if len(text) <= OFF_LOOP_TOKENIZE_CHARS or self._backend_encode is None:
            return self.encode(text, add_special_tokens)
        batch_encode = self.tokenizer.backend_tokenizer.encode_batch
        loop = asyncio.get_running_loop()
        encodings = await loop.run_in_executor(None, lambda: batch_encode([text], add_special_tokens=add_special_tokens))
        return encodings[0].ids

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, on a worker thread for a long list (as `encode_async`)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if (len(ids) <= OFF_LOOP_TOKENIZE_CHARS or backend is None
                or getattr(self.tokenizer, "clean_up_tokenization_spaces", False)):
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        loop = asyncio.get_running_loop()
        texts = await loop.run_in_executor(None, lambda: backend.decode_batch([ids], skip_special_tokens=skip_special_tokens))
        return texts[0]

    def check_text_length(self, param: str, text: str) -> None:
        """Refuses, before tokenizing it, a text too long to fit the context in any case."""
        limit = self.info.context_len * self.max_token_chars * 2
        if len(text) > limit:
            raise InvalidParameter(param, f"{param} has {len(text)} characters: far more tokens than the context "
                                          f"length ({self.info.context_len}) holds; shorten it")

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    async def tokenize_item(self, item: GenerateReqInput) -> TokenizedGenerateReqInput:
        for name in ("image_data", "audio_data", "video_data"):
            if getattr(item, name) is not None:
                kind = name.split("_")[0]
                raise InvalidParameter(name, f"{name}: this model does not accept {kind} input")
        params = SamplingParams.from_dict(item.sampling_params)
        params.verify(self.info.vocab_size)
        self._check_logprob_size(item, params)
        if item.text is not None:
            self.check_text_length("text", item.text)
            input_ids = await self.encode_async(item.text)
        else:
            input_ids = list(item.input_ids)
            bad = [t for t in input_ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise InvalidParameter("input_ids", f"input_ids: token id {bad[0]} is outside the "
                                                    f"vocabulary [0, {self.info.vocab_size})")
        if not input_ids:
            raise InvalidParameter("text", "text: the prompt is empty after tokenization")
        ctx = self.info.context_len
        if len(input_ids) >= ctx:
            raise InvalidParameter("text" if item.text is not None else "input_ids",
                                   f"the prompt has {len(input_ids)} tokens, which is at least the "
                                   f"context length ({ctx}); shorten it")
        if len(input_ids) + params.max_new_tokens > ctx:
            raise InvalidParameter("max_new_tokens",
                                   f"max_new_tokens: the prompt ({len(input_ids)} tokens) plus max_new_tokens "
                                   f"({params.max_new_tokens}) exceeds the context length ({ctx}); lower it "
                                   f"to at most {ctx - len(input_ids)}")
        if params.regex or params.json_schema or params.ebnf:
            field_name = "regex" if params.regex else "json_schema" if params.json_schema else "ebnf"
            raise InvalidParameter(field_name, f"{field_name}: constrained decoding is not supported by this "
                                               "server yet; remove the field")
        if len(input_ids) + params.max_new_tokens > self.info.max_total_tokens:
            raise InvalidParameter("max_new_tokens",
                                   f"max_new_tokens: the prompt ({len(input_ids)} tokens) plus max_new_tokens "
                                   f"({params.max_new_tokens}) needs more KV memory than the whole pool holds "
                                   f"({self.info.max_total_tokens} tokens); lower max_new_tokens")
        vocab = self.info.vocab_size
        bad = [t for t in item.token_ids_logprob or () if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter("token_ids_logprob", f"token_ids_logprob: token id {bad[0]} is outside the "
                                                        f"vocabulary [0, {vocab})")
        if (item.top_logprobs_num or 0) > vocab:
            raise InvalidParameter("top_logprobs_num", f"top_logprobs_num ({item.top_logprobs_num}) must be at "
                                                       f"most the vocabulary size ({vocab})")
        start_len = item.logprob_start_len
        if item.return_logprob and start_len >= 0:
            num_positions = len(input_ids) - start_len + params.max_new_tokens
            self._check_logprob_entries(item, num_positions)
        if item.return_logprob and start_len >= len(input_ids):
            raise InvalidParameter("logprob_start_len", f"logprob_start_len ({start_len}) must be below "
                                                        f"the prompt length ({len(input_ids)})")
        return TokenizedGenerateReqInput(
            rid=item.rid, input_text=item.text, input_ids=input_ids, sampling_params=params,
            return_logprob=bool(item.return_logprob), logprob_start_len=start_len,
            top_logprobs_num=item.top_logprobs_num or 0, token_ids_logprob=item.token_ids_logprob,
            stream=item.stream, lora_path=item.lora_path, http_worker_ipc=self.worker_ipc,
        )

    def _check_logprob_size(self, item: GenerateReqInput, params: SamplingParams) -> None:
        top = item.top_logprobs_num or 0
        if top > MAX_TOP_LOGPROBS_NUM:
            raise InvalidParameter("top_logprobs_num", f"top_logprobs_num must be at most {MAX_TOP_LOGPROBS_NUM}, "
                                                       f"got {top}")
        if item.return_logprob:
            self._check_logprob_entries(item, params.max_new_tokens)

    def _check_logprob_entries(self, item: GenerateReqInput, num_positions: int) -> None:
        per_position = 1 + (item.top_logprobs_num or 0) + len(item.token_ids_logprob or ())
        if num_positions * per_position > MAX_LOGPROB_ENTRIES:
            raise InvalidParameter(
                "top_logprobs_num", f"the logprobs asked for ({num_positions} positions x {per_position} entries) "
                                    f"exceed {MAX_LOGPROB_ENTRIES} entries per request; ask for fewer "
                                    "top_logprobs_num, token_ids_logprob or positions (logprob_start_len, "
                                    "max_new_tokens)")

    def _check_num_items(self, obj: GenerateReqInput) -> None:
        """Refuses a request with more items (prompts x n) than the server can hold at once,
        before any item is built."""
        num_prompts = 1
        prompts = obj.text if obj.text is not None else obj.input_ids
        if isinstance(prompts, list) and prompts and (obj.text is not None or isinstance(prompts[0], list)):
            num_prompts = len(prompts)
        params = obj.sampling_params
        n = 1
        for sp in (params if isinstance(params, list) else [params]):
            value = sp.get("n") if isinstance(sp, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                n = max(n, int(value))
        if num_prompts * n > self.max_pending:
            raise InvalidParameter("n" if n > 1 else "text" if obj.text is not None else "input_ids",
                                   f"the request has {num_prompts} prompt(s) x n={n} = {num_prompts * n} items; "
                                   f"this server takes at most {self.max_pending} in flight")

    async def prepare(self, obj: GenerateReqInput) -> list[TokenizedGenerateReqInput]:
        """Normalizes and checks every item; raises InvalidParameter before anything is sent."""
        if not obj.is_normalized:
            self._check_num_items(obj)
        obj.normalize_batch_and_arguments()
        items = [obj.item(i) for i in range(obj.batch_size)] if not obj.is_single else [obj]
        for it in items:
            if it.rid in self.states:
                raise InvalidParameter("rid", f"rid: {it.rid!r} is already in use by a live request")
        tokenized = [await self.tokenize_item(it) for it in items]
        if obj.parallel_sample_num > 1:
            for j, t in enumerate(tokenized):
                if t.sampling_params.seed is not None:
                    # Samples of one prompt must differ, yet stay reproducible for a given seed.
                    t.sampling_params.seed += j % obj.parallel_sample_num
        return tokenized

    # ---- request life -----------------------------------------------------------------

    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[Any]:
        """Yields results: one final dict (or list for a batch), or stream chunks (dicts with
        an `index` for batches) when `obj.stream`. Raises InvalidParameter / RequestError."""
        tokenized = await self.prepare(obj)
        if len(self.states) + len(tokenized) > self.max_pending:
            raise RequestError(429, "the server is overloaded: too many requests in flight; retry later")
        now = time.monotonic()
        items = [obj] if obj.is_single else [obj.item(i) for i in range(obj.batch_size)]
        for item in items:
            hooks.request_received(item)  # may raise to refuse; nothing is registered or sent yet
        states = []
        for item, tok in zip(items, tokenized):
            st = _ReqState(item, now)
            self.states[tok.rid] = st
            states.append(st)
        deadline = None
        if self.request_timeout_s is not None:
            deadline = asyncio.get_running_loop().call_later(self.request_timeout_s, self._expire, tokenized)
        try:
            for tok in tokenized:
                self.send(tok)
            if obj.stream:
                async for chunk in self._stream(states, obj.is_single):
                    yield chunk
            else:
                results = [await self._wait_final(st) for st in states]
                yield results[0] if obj.is_single else results
        finally:
            if deadline is not None:
                deadline.cancel()
            for tok, st in zip(tokenized, states):
                if not st.finished:
                    self.abort_request(tok.rid, "the client went away")
                    hooks.notify(hooks.request_finished, tok.rid,
                                 {**st.meta, "finish_reason": {"type": "abort", "message": "the client went away"}})
                self.states.pop(tok.rid, None)

    def _expire(self, tokenized: list[TokenizedGenerateReqInput]) -> None:
        """The server-side deadline passed: the scheduler ends what still runs (finish reason
        abort) and the client gets what was generated so far."""
        message = f"the request ran past the server's deadline (--request-timeout-s {self.request_timeout_s:g})"
        for tok in tokenized:
            st = self.states.get(tok.rid)
            if st is not None and not st.finished:
                self.send(AbortReq(rid=tok.rid, message=message, http_worker_ipc=self.worker_ipc))

    async def _wait_final(self, st: _ReqState) -> dict:
        while not st.finished:
            await st.event.wait()
            st.event.clear()
        st.chunks.clear()
        return self._result(st, st.text, st.output_ids)

    def _take_delta(self, st: _ReqState) -> dict | None:
        """What `st` produced since the last call as a delta result (None if nothing).
        Raises the request's RequestError if it failed."""
        deltas, st.chunks = st.chunks, []
        text = "".join(d[0] for d in deltas)
        ids = [t for d in deltas for t in d[1]]
        if text or ids or st.finished:
            return self._result(st, text, ids, delta=True)
        return None

    async def _stream(self, states: list[_ReqState], is_single: bool):
        if len(states) == 1:
            # One request (the common case): wait on it directly. Every streamed token passes
            # here, so no helper task and queue in between.
            st = states[0]
            while True:
                await st.event.wait()
                st.event.clear()
                done = st.finished  # as of this delta: more may arrive while the consumer holds it
                chunk = self._take_delta(st)
                if chunk is not None:
                    if not is_single:
                        chunk["index"] = 0
                    yield chunk
                if done:
                    return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, st: _ReqState):
            while True:
                await st.event.wait()
                st.event.clear()
                try:
                    chunk = self._take_delta(st)
                except RequestError as e:  # a failed request: the consumer raises it
                    chunk = e
                if chunk is not None:
                    await queue.put((index, chunk))
                if st.finished:
                    await queue.put((index, None))
                    return

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(states)]
        try:
            remaining = len(states)
            while remaining:
                index, chunk = await queue.get()
                if chunk is None:
                    remaining -= 1
                    continue
                if isinstance(chunk, RequestError):
                    raise chunk
                if not is_single:
                    chunk["index"] = index
                yield chunk
        finally:
            for t in tasks:
                t.cancel()

    def _result(self, st: _ReqState, text: str, ids: list[int], delta: bool = False) -> dict:
        """A result dict; with `delta`, text, ids and logprobs are only what is new since the last one."""
        meta = dict(st.meta)
        meta["id"] = st.obj.rid
        meta["e2e_latency"] = time.monotonic() - st.created
        if st.obj.return_logprob:
            for name in _LP_FIELDS:
                values = st.logprobs.get(name, [])
                if delta:
                    start = st.logprobs_sent.get(name, 0)
                    st.logprobs_sent[name] = len(values)
                    values = values[start:]
                meta[name] = self._with_text(values, st.obj.return_text_in_logprobs, nested="top" in name or "ids" in name)
        reason = meta.get("finish_reason")
        if reason and reason.get("type") == "abort" and reason.get("status_code", 200) >= 400:
            raise RequestError(reason["status_code"], reason.get("message", "request failed"),
                               is_request_fault=bool(reason.get("request_fault")))
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _with_text(self, values: list, with_text: bool, nested: bool) -> list:
        def one(v, i):
            return [v, i, self.token_text(i) if with_text else None]
        if nested:
            return [[one(v, i) for v, i in zip(*row)] if row[0] is not None else None for row in values]
        return [one(v, i) for v, i in values]

    # ---- results in (called on the event loop) ------------------------------------------------

    def handle_output(self, out: BatchStrOutput) -> None:
        for i, rid in enumerate(out.rids):
            st = self.states.get(rid)
            if st is None:
                continue  # the client already left; its abort is on the way
            if st.finished:
                # Final once finished: the scheduler's own outputs still in flight after the front
                # ended a request (end_all on shutdown) must not overwrite its finish reason.
                continue
            try:
                self._add_output(st, rid, out, i)
            except Exception as e:  # this request fails alone; the others get their outputs
                logger.exception("taking the output of request %s failed; it ends with an error", rid)
                self._fail(st, rid, f"internal error while taking its output: {type(e).__name__}: {e}")

    def _fail(self, st: _ReqState, rid: str, message: str) -> None:
        self.num_request_faults["front"] += 1
        st.meta["finish_reason"] = {"type": "abort", "status_code": 500, "request_fault": True, "message": message}
        st.finished = True
        self.abort_request(rid, message)
        hooks.notify(hooks.request_finished, rid, dict(st.meta))
        st.event.set()

    def _add_output(self, st: _ReqState, rid: str, out: BatchStrOutput, i: int) -> None:
        reason = out.finished_reasons[i]
        if reason is not None and reason.get("request_fault"):
            origin = reason.get("origin", "scheduler")
            self.num_request_faults[origin] = self.num_request_faults.get(origin, 0) + 1
            if origin == "detokenizer":
                self.abort_request(rid, reason.get("message", "failed"))  # it still runs in the scheduler
        st.text += out.output_strs[i]
        st.output_ids.extend(out.output_ids[i])
        st.chunks.append((out.output_strs[i], out.output_ids[i]))
        st.meta.update(prompt_tokens=out.prompt_tokens[i], completion_tokens=out.completion_tokens[i],
                       cached_tokens=out.cached_tokens[i], finish_reason=reason)
        if out.logprobs and out.logprobs[i] is not None:
            self._add_logprobs(st, out.logprobs[i])
        if reason is not None:
            st.finished = True
            hooks.notify(hooks.request_finished, rid, dict(st.meta))
        st.event.set()

    @staticmethod
    def _add_logprobs(st: _ReqState, lp: Logprobs) -> None:
        for name in _LP_FIELDS:
            vals, idxs = getattr(lp, f"{name}_val"), getattr(lp, f"{name}_idx")
            if vals is not None:
                st.logprobs.setdefault(name, []).extend(zip(vals, idxs))

    def abort_request(self, rid: str | None = None, message: str = "aborted", abort_all: bool = False) -> None:
        """Asks the scheduler to end the request(s); `rid` also matches the samples `rid-j` of n > 1."""
        if abort_all:
            self.send(AbortReq(abort_all=True, message=message, http_worker_ipc=self.worker_ipc))
            return
        targets = [r for r in self.states if r == rid or r.startswith(f"{rid}-")] or [rid]
        for r in targets:
            self.send(AbortReq(rid=r, message=message, http_worker_ipc=self.worker_ipc))
