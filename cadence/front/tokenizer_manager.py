"""The front's generation requests: send checked requests, gather their results by rid.

Both protocol adapters and the in-process `Engine` reach it through one `EngineClient`
(`front/client.py`), so validation and results can never drift apart. It checks requests
through `RequestChecker` and keeps them in the front's one `RequestBook` (rid registry,
admission budget, deadline, abort on leave, end_all); as the book's generation kind it
turns each row of a `BatchStrOutput` into its request's text, ids and logprobs. Whether
messages travel over ZMQ or stay in one process is the client's business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cadence import hooks
from cadence.errors import RequestError
from cadence.front.engine_client import ModelInfo
from cadence.front.lora import LoRARegistry
from cadence.front.metrics import RequestTimer
from cadence.front.normalize import items as normalized_items
from cadence.front.request_book import LiveRequest, RequestBook, RequestKind, until_finished
from cadence.front.request_checks import RequestChecker, RequestOptions
from cadence.front.request_log import RequestLog
from cadence.front.tokenizer import FrontTokenizer
from cadence.io_struct import (
    BatchStrOutput,
    GenerateReqInput,
    Logprobs,
    TokenizedGenerateReqInput,
)

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, eq=False)
class _ReqState(LiveRequest):
    obj: GenerateReqInput  # the single item
    # (text, ids) deltas not yet yielded
    chunks: list[tuple[str, list[int]]] = field(default_factory=list)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list] = field(default_factory=dict)
    logprobs_sent: dict[str, int] = field(default_factory=dict)  # stream: entries already yielded
    hidden: list[list[float]] = field(default_factory=list)  # final hidden states, per position
    timer: RequestTimer | None = None  # its latencies and tokens, for /metrics


_LP_FIELDS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
)


class TokenizerManager(RequestKind[_ReqState]):
    def __init__(
        self,
        tokenizer: FrontTokenizer,
        info: ModelInfo,
        book: RequestBook,
        max_pending: int = 1088,
        options: RequestOptions | None = None,
        lora: LoRARegistry | None = None,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.book = book
        self.max_pending = max_pending
        self.checker = RequestChecker(tokenizer, info, max_pending, options, lora)
        opts = options or RequestOptions()
        self.log = RequestLog(opts.log_requests, opts.log_requests_level)

    @property
    def states(self) -> dict[str, LiveRequest]:
        """The live generations by rid."""
        return self.book.of_kind(self)

    async def prepare(self, obj: GenerateReqInput) -> list[TokenizedGenerateReqInput]:
        """Checks and tokenizes every item; raises InvalidParameter before anything is sent."""
        tokenized = await self.checker.check_generate(obj, self.book.worker_ipc)
        self.book.check_rids([t.rid for t in tokenized])
        return tokenized

    # ---- request life -----------------------------------------------------------------

    async def generate_request(self, obj: GenerateReqInput) -> AsyncGenerator[Any, None]:
        """Yields results: one final dict (or list for a batch), or stream chunks (dicts with
        an `index` for batches) when `obj.stream`. Raises InvalidParameter / RequestError."""
        tokenized = await self.prepare(obj)
        self.book.check_room(len(tokenized), self.max_pending)
        items = normalized_items(obj)  # the same items the checker cut
        for item in items:
            hooks.request_received(item)  # may raise to refuse; nothing is booked or sent yet
        now = time.monotonic()
        model = self.info.served_model_name
        states = [
            _ReqState(rid=tok.rid, kind=self, created=now, obj=item, timer=RequestTimer(model, now))
            for item, tok in zip(items, tokenized)
        ]
        with self.book.hold(states):
            for tok in tokenized:
                self.log.received(tok)
                self.book.send(tok)
            if obj.stream:
                async for chunk in self._stream(states, obj.is_single):
                    yield chunk
            else:
                results = [await self._wait_final(st) for st in states]
                yield results[0] if obj.is_single else results

    async def _wait_final(self, st: _ReqState) -> dict:
        await until_finished(st)
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

    def _stream(self, states: list[_ReqState], is_single: bool) -> AsyncIterator[dict]:
        if len(states) == 1:
            return self._stream_one(states[0], is_single)
        return self._stream_many(states, is_single)

    async def _stream_one(self, st: _ReqState, is_single: bool) -> AsyncIterator[dict]:
        """One request (the common case): waits on it directly. Every streamed token passes
        here, so no helper task and queue in between."""
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

    async def _stream_many(self, states: list[_ReqState], is_single: bool) -> AsyncIterator[dict]:
        """Several requests (a batch, n > 1): each one's deltas as they come, by index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, st: _ReqState):
            while True:
                await st.event.wait()
                st.event.clear()
                chunk: dict | RequestError | None
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
                meta[name] = self._with_text(
                    values, st.obj.return_text_in_logprobs, nested="top" in name or "ids" in name
                )
        reason = meta.get("finish_reason")
        if st.obj.return_hidden_states and reason is not None:
            # SGLang's shape: the prompt's block [prompt_len][hidden], then one vector per
            # decode step (the last prompt position already produced the first token).
            num_prompt = meta.get("prompt_tokens", 0)
            meta["hidden_states"] = [st.hidden[:num_prompt], *st.hidden[num_prompt:]]
        if reason and reason.get("type") == "abort" and reason.get("status_code", 200) >= 400:
            raise RequestError(
                reason["status_code"],
                reason.get("message", "request failed"),
                param=reason.get("param"),
                is_request_fault=bool(reason.get("request_fault")),
            )
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _with_text(self, values: list, with_text: bool, nested: bool) -> list:
        def one(v, i):
            return [v, i, self.tokenizer.token_text(i) if with_text else None]

        if nested:
            return [
                [one(v, i) for v, i in zip(*row)] if row[0] is not None else None for row in values
            ]
        return [one(v, i) for v, i in values]

    # ---- the book's generation kind (called on the event loop) ---------------------------

    def take_output(self, st: _ReqState, out: BatchStrOutput, i: int) -> bool:
        reason = out.finished_reasons[i]
        if reason is not None and reason.get("request_fault"):
            origin = reason.get("origin", "scheduler")
            self.book.record_fault(origin)
            if origin == "detokenizer":  # it still runs in the scheduler
                self.book.abort(st.rid, reason.get("message", "failed"))
        st.text += out.output_strs[i]
        st.output_ids.extend(out.output_ids[i])
        st.chunks.append((out.output_strs[i], out.output_ids[i]))
        st.meta.update(
            prompt_tokens=out.prompt_tokens[i],
            completion_tokens=out.completion_tokens[i],
            cached_tokens=out.cached_tokens[i],
            finish_reason=reason,
            weight_version=out.weight_version,
        )
        if out.spec_verify_ct and out.spec_verify_ct[i]:  # once it drafted
            st.meta.update(spec_meta(out, i))
        logprobs = out.logprobs[i] if out.logprobs else None
        if logprobs is not None:
            self._add_logprobs(st, logprobs)
        hidden = out.hidden_states[i] if out.hidden_states else None
        if hidden:
            st.hidden.extend(hidden)
        if st.timer is not None:
            st.timer.on_tokens(len(out.output_ids[i]), time.monotonic())
        return reason is not None

    def on_finish(self, st: _ReqState) -> None:
        now = time.monotonic()
        if st.timer is not None:
            st.timer.on_finish(st.meta, now)
        self.log.finished(st.rid, st.meta, st.text, st.output_ids, now - st.created)
        hooks.notify(hooks.request_finished, st.rid, dict(st.meta))

    def on_leave(self, st: _ReqState, message: str) -> None:
        meta = {**st.meta, "finish_reason": {"type": "abort", "message": message}}
        now = time.monotonic()
        if st.timer is not None:
            st.timer.on_finish(meta, now)
        self.log.finished(st.rid, meta, st.text, st.output_ids, now - st.created)
        hooks.notify(hooks.request_finished, st.rid, meta)

    @staticmethod
    def _add_logprobs(st: _ReqState, lp: Logprobs) -> None:
        for name in _LP_FIELDS:
            vals, idxs = getattr(lp, f"{name}_val"), getattr(lp, f"{name}_idx")
            if vals is not None:
                st.logprobs.setdefault(name, []).extend(zip(vals, idxs))

    def backlog(self, rids: list[str], consumed: int) -> int:
        """Tokens these requests produced beyond `consumed` (0 once none of them is live)."""
        live = [self.book.get(rid) for rid in rids]
        produced = sum(len(st.output_ids) for st in live if isinstance(st, _ReqState))
        return produced - consumed if produced else 0


def spec_meta(out: BatchStrOutput, i: int) -> dict:
    """Speculative decoding's figures of request i, by SGLang's meta_info names: verify steps,
    draft tokens accepted (the token sampled after them not counted) and proposed, steps by
    number accepted; the rate accepted / proposed and the tokens a verify step gave on
    average (the sampled one included)."""
    verify = (out.spec_verify_ct or [0] * (i + 1))[i]
    accepted = (out.spec_accepted_tokens or [0] * (i + 1))[i]
    proposed = (out.spec_proposed_tokens or [0] * (i + 1))[i]
    return {
        "spec_verify_ct": verify,
        "spec_accepted_tokens": accepted,
        "spec_num_proposed_drafts": proposed,
        "spec_acceptance_histogram": (out.spec_acceptance_histogram or [[]] * (i + 1))[i],
        "spec_accept_rate": accepted / proposed if proposed else 0.0,
        "spec_accept_length": (accepted + verify) / verify if verify else 0.0,
    }
