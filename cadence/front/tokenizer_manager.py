"""The front's per-request state: send checked requests, gather their results by rid.

Both protocol adapters and the in-process `Engine` reach it through one `EngineClient`
(`front/client.py`), so validation and results can never drift apart. It checks requests
through `RequestChecker`, talks to the scheduler through a `send` callable and receives
`BatchStrOutput`s via `handle_output`; whether those travel over ZMQ or stay in one process
is the client's business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cadence import hooks
from cadence.errors import InvalidParameter, RequestError
from cadence.front import metrics
from cadence.front.engine_client import ModelInfo
from cadence.front.metrics import RequestTimer
from cadence.front.normalize import duplicate_rid_message
from cadence.front.normalize import items as normalized_items
from cadence.front.request_checks import RequestChecker, RequestOptions
from cadence.front.tokenizer import FrontTokenizer
from cadence.io_struct import (
    AbortReq,
    BatchStrOutput,
    GenerateReqInput,
    Logprobs,
    TokenizedGenerateReqInput,
)

logger = logging.getLogger(__name__)


@dataclass
class _ReqState:
    obj: GenerateReqInput  # the single item
    created: float
    chunks: list[tuple[str, list[int]]] = field(
        default_factory=list
    )  # (text, ids) deltas not yet yielded
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
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


class TokenizerManager:
    def __init__(
        self,
        tokenizer: FrontTokenizer,
        info: ModelInfo,
        send: Callable[[Any], None],
        max_pending: int = 1088,
        worker_ipc: str | None = None,
        request_timeout_s: float | None = None,
        options: RequestOptions | None = None,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.send = send
        self.max_pending = max_pending
        self.worker_ipc = worker_ipc
        self.request_timeout_s = request_timeout_s
        self.checker = RequestChecker(tokenizer, info, max_pending, options)
        self.states: dict[str, _ReqState] = {}
        # Requests that ended in an internal error of their own, by where it happened.
        self.num_request_faults: dict[str, int] = {"scheduler": 0, "detokenizer": 0, "front": 0}

    async def prepare(self, obj: GenerateReqInput) -> list[TokenizedGenerateReqInput]:
        """Checks and tokenizes every item; raises InvalidParameter before anything is sent."""
        tokenized = await self.checker.check_generate(obj, self.worker_ipc)
        for t in tokenized:
            if t.rid in self.states:
                raise InvalidParameter("rid", duplicate_rid_message(t.rid))
        return tokenized

    # ---- request life -----------------------------------------------------------------

    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[Any]:
        """Yields results: one final dict (or list for a batch), or stream chunks (dicts with
        an `index` for batches) when `obj.stream`. Raises InvalidParameter / RequestError."""
        tokenized = await self.prepare(obj)
        if len(self.states) + len(tokenized) > self.max_pending:
            raise RequestError(
                429, "the server is overloaded: too many requests in flight; retry later"
            )
        now = time.monotonic()
        items = normalized_items(obj)  # the same items the checker cut
        for item in items:
            hooks.request_received(item)  # may raise to refuse; nothing is registered or sent yet
        states = []
        model = self.info.served_model_name
        for item, tok in zip(items, tokenized):
            st = _ReqState(item, now, timer=RequestTimer(model, now))
            self.states[tok.rid] = st
            states.append(st)
        deadline = None
        if self.request_timeout_s is not None:
            deadline = asyncio.get_running_loop().call_later(
                self.request_timeout_s, self._expire, tokenized
            )
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
                    st.timer.on_finish(
                        {**st.meta, "finish_reason": {"type": "abort"}}, time.monotonic()
                    )
                    self.abort_request(tok.rid, "the client went away")
                    hooks.notify(
                        hooks.request_finished,
                        tok.rid,
                        {
                            **st.meta,
                            "finish_reason": {"type": "abort", "message": "the client went away"},
                        },
                    )
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
                logger.exception(
                    "taking the output of request %s failed; it ends with an error", rid
                )
                self._fail(
                    st, rid, f"internal error while taking its output: {type(e).__name__}: {e}"
                )

    def _fail(self, st: _ReqState, rid: str, message: str) -> None:
        self.num_request_faults["front"] += 1
        metrics.record_fault("front")
        st.meta["finish_reason"] = {
            "type": "abort",
            "status_code": 500,
            "request_fault": True,
            "message": message,
        }
        st.finished = True
        if st.timer is not None:
            st.timer.on_finish(st.meta, time.monotonic())
        self.abort_request(rid, message)
        hooks.notify(hooks.request_finished, rid, dict(st.meta))
        st.event.set()

    def _add_output(self, st: _ReqState, rid: str, out: BatchStrOutput, i: int) -> None:
        reason = out.finished_reasons[i]
        if reason is not None and reason.get("request_fault"):
            origin = reason.get("origin", "scheduler")
            self.num_request_faults[origin] = self.num_request_faults.get(origin, 0) + 1
            metrics.record_fault(origin)
            if origin == "detokenizer":
                self.abort_request(
                    rid, reason.get("message", "failed")
                )  # it still runs in the scheduler
        st.text += out.output_strs[i]
        st.output_ids.extend(out.output_ids[i])
        st.chunks.append((out.output_strs[i], out.output_ids[i]))
        st.meta.update(
            prompt_tokens=out.prompt_tokens[i],
            completion_tokens=out.completion_tokens[i],
            cached_tokens=out.cached_tokens[i],
            finish_reason=reason,
        )
        if out.logprobs and out.logprobs[i] is not None:
            self._add_logprobs(st, out.logprobs[i])
        if out.hidden_states and out.hidden_states[i]:
            st.hidden.extend(out.hidden_states[i])
        if st.timer is not None:
            now = time.monotonic()
            st.timer.on_tokens(len(out.output_ids[i]), now)
            if reason is not None:
                st.timer.on_finish(st.meta, now)
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

    def abort_request(
        self, rid: str | None = None, message: str = "aborted", abort_all: bool = False
    ) -> None:
        """Asks the scheduler to end the request(s); `rid` also matches the samples `rid-j` of n > 1."""
        if abort_all:
            self.send(AbortReq(abort_all=True, message=message, http_worker_ipc=self.worker_ipc))
            return
        targets = self.matching(rid) or [rid]
        for r in targets:
            self.send(AbortReq(rid=r, message=message, http_worker_ipc=self.worker_ipc))

    def matching(self, rid: str) -> list[str]:
        """The live rids `rid` names: itself, or the samples `rid-j` of an n > 1 request."""
        return [r for r in self.states if r == rid or r.startswith(f"{rid}-")]

    def backlog(self, rids: list[str], consumed: int) -> int:
        """Tokens these requests produced beyond `consumed` (0 once none of them is live)."""
        produced = sum(len(self.states[rid].output_ids) for rid in rids if rid in self.states)
        return produced - consumed if produced else 0

    def end_all(self, message: str, status: int = 503) -> None:
        """Ends every request at once with an error of `status`, without waiting for the
        scheduler (the server is stopping, or a child died and will never answer)."""
        if not self.states:
            return
        self.send(AbortReq(abort_all=True, message=message, http_worker_ipc=self.worker_ipc))
        reason = {"type": "abort", "message": message, "status_code": status}
        for rid, st in list(self.states.items()):
            if not st.finished:
                st.meta["finish_reason"] = dict(reason)
                st.finished = True
                hooks.notify(hooks.request_finished, rid, dict(st.meta))
                st.event.set()
