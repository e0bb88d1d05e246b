"""The scheduler core: `handle(msg)` for every message, `step()` for the loop.

One core serves both the scheduler process (`scheduler/process.py`, over ZMQ) and the
in-process `Engine` (on a thread): every request and control message goes through one
dispatch table, and a step is schedule -> run -> postprocess.

The prefix cache (`mem_cache/prefix_cache.py`) keeps the KV of what requests computed: a
request admitted with a cached prefix takes those pages (one more hold each, and a lock on
their tree node) and prefills only the rest. A request's computed whole pages go into the
cache after every prefill chunk and when it ends; its lock and holds are released then,
so the pages stay cached (evictable) until memory is needed. Admission counts evictable
pages as free and evicts before it makes a request wait. With `--schedule-policy lpm`
waiting requests are taken longest cached prefix first, and a request whose next pages
another request of the same round is computing waits one round to share them (n > 1,
batches with a common prefix).

Single-threaded by design: only the thread that calls `handle` and `step` touches requests,
KV pages or queues. The scheduler borrows the KV allocator (it decides who holds which
page) and asks the runner to run a batch; it never touches model internals. Admission
reserves every page a request can ever need (prompt plus max_new_tokens), so a running
request never runs out of KV memory mid-generation; a request that does not fit yet waits.
Requests arrive checked by the front and are trusted.

Failures are isolated per request: an exception while admitting, preparing, sampling,
computing logprobs or checking the stop conditions of one request fails that request alone
(a 500 marked as caused by the request, its KV pages freed) and the batch goes on. Only the
model forward itself, which every request in the batch shares, may raise out of `step()`.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from cadence import hooks
from cadence.constrained import grammar_key
from cadence.constrained.grammar_queue import GrammarQueue
from cadence.io_struct import (
    REPLY_TYPES,
    AbortReq,
    BatchTokenizedEmbeddingReqInput,
    CloseSessionReqInput,
    CloseSessionReqOutput,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    OpenSessionReqInput,
    OpenSessionReqOutput,
    PauseGenerationReqInput,
    ProfileReq,
    ProfileReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
)
from cadence.layers.sampler import SamplingInput
from cadence.mem_cache.allocator import KVAllocator
from cadence.mem_cache.prefix_cache import NoPrefixCache, PrefixCache, RadixCache
from cadence.model_executor.runner import BatchItem, ItemResult, Runner, ScheduleBatch
from cadence.scheduler.embedding import EmbeddingQueue, embed_req_from_tokenized
from cadence.scheduler.kv_book import KvBook
from cadence.scheduler.profiler import Profiler
from cadence.scheduler.req import Req, ReqOutput, req_from_tokenized
from cadence.scheduler.sessions import SessionController, SessionError
from cadence.scheduler.stop_checker import StopChecker
from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Beyond this many waiting requests, lpm falls back to arrival order (matching every waiting
# request each round would cost more than it saves).
LPM_MAX_WAITING = 128
# With nothing else to run, the loop waits this long at most for a grammar to compile.
GRAMMAR_POLL_S = 0.005


def _is_sample_of(rid: str, parent: str | None) -> bool:
    """Whether `rid` is sample j of the n > 1 request `parent` (f"{parent}-{j}")."""
    return (
        parent is not None
        and rid.startswith(parent)
        and rid[len(parent) : len(parent) + 1] == "-"
        and rid[len(parent) + 1 :].isdigit()
    )


def _auto_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before every text it encodes, if it does (a session's
    appended turn drops it); None when it adds none."""
    try:
        ids = tokenizer.encode("a")
        bos = tokenizer.bos_token_id
    except Exception:  # no tokenizer, or one without these: nothing to drop
        return None
    return bos if bos is not None and ids and ids[0] == bos else None


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        runner: Runner,
        allocator: KVAllocator,
        stop_checker: StopChecker,
        prefix_cache: PrefixCache | None = None,
        grammars: GrammarQueue | None = None,
    ):
        self.args = args
        self.runner = runner
        self.allocator = allocator
        self.stops = stop_checker
        # Requests whose constraint is compiling wait here, outside the waiting queue.
        self.grammars = grammars
        if prefix_cache is None:
            prefix_cache = (
                NoPrefixCache(allocator.page_size)
                if args.disable_radix_cache
                else RadixCache(allocator)
            )
        self.cache = prefix_cache
        self.caching = not isinstance(prefix_cache, NoPrefixCache)
        self.kv = KvBook(allocator, prefix_cache, self.caching)
        self.lpm = args.effective_schedule_policy == "lpm"
        self.sessions = SessionController(
            prefix_cache,
            lambda req, why: self._end(req, {"type": "abort", "message": why}),
            _auto_bos(getattr(stop_checker, "tokenizer", None)),
            args.effective_session_timeout_s,
        )
        self.num_prompt_tokens = 0  # prompt tokens admitted (first admissions)
        self.num_cache_hit_tokens = 0  # of those, served from the prefix cache
        self.context_len = runner.context_len
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # prefill complete, decoding
        self.chunked: Req | None = None  # admitted, prefill in progress
        self.is_paused = False
        self.outputs: list[ReqOutput] = []  # and EmbedOutputs (see `to_messages`)
        # Embedding requests: one forward pass per input, in steps of at most the prefill budget.
        self.embeds = EmbeddingQueue(runner, allocator, self.cache, args.chunked_prefill_size)
        self.profiler = Profiler(args.effective_profile_dir, runner.profiler_activities)
        self.num_generated_tokens = 0
        self.num_failed_requests = 0  # requests ended by an error of their own (see `fail`)
        self._throughput_window: deque[tuple[float, int]] = deque(maxlen=64)
        self._handlers = {
            TokenizedGenerateReqInput: self._on_generate,
            TokenizedEmbeddingReqInput: self._on_embed,
            BatchTokenizedEmbeddingReqInput: self._on_embed_batch,
            AbortReq: self._on_abort,
            FlushCacheReqInput: self._on_flush,
            PauseGenerationReqInput: self._on_pause,
            ContinueGenerationReqInput: self._on_continue,
            GetLoadReqInput: self._on_get_load,
            ProfileReq: self._on_profile,
            UpdateWeightFromDiskReqInput: self._on_update_weights,
            OpenSessionReqInput: self._on_open_session,
            CloseSessionReqInput: self._on_close_session,
        }

    # ---- messages in ---------------------------------------------------------------------

    def handle(self, msg):
        """Handles one message; returns the answer its sender waits for, or None. A message
        that fails is answered with a failure (a request: its own error), never raised."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.error("the scheduler got an unexpected %s", type(msg).__name__)
            return None
        try:
            reply = handler(msg)
        except Exception as e:
            logger.exception("handling %s failed", type(msg).__name__)
            reply = None
            if isinstance(msg, TokenizedGenerateReqInput):
                self.fail(req_from_tokenized(msg), e, "being admitted")
            elif isinstance(msg, TokenizedEmbeddingReqInput):
                self.outputs.append(self.embeds.fail(embed_req_from_tokenized(msg), e, "queued"))
            elif isinstance(msg, BatchTokenizedEmbeddingReqInput):
                for item in msg.batch:
                    self.outputs.append(
                        self.embeds.fail(embed_req_from_tokenized(item), e, "queued")
                    )
            elif type(msg) in REPLY_TYPES:
                reply = REPLY_TYPES[type(msg)](
                    success=False, message=f"internal error: {type(e).__name__}: {e}"
                )
        if reply is not None:  # it goes back to the front that asked, to the caller that asked
            reply.http_worker_ipc = msg.http_worker_ipc
            reply.cid = msg.cid
        return reply

    def _on_generate(self, msg: TokenizedGenerateReqInput) -> None:
        self.add_request(req_from_tokenized(msg))

    def _on_embed(self, msg: TokenizedEmbeddingReqInput) -> None:
        self.embeds.add([embed_req_from_tokenized(msg)])

    def _on_embed_batch(self, msg: BatchTokenizedEmbeddingReqInput) -> None:
        self.embeds.add([embed_req_from_tokenized(item) for item in msg.batch])  # all or none

    def _on_abort(self, msg: AbortReq) -> None:
        self.abort(msg.rid, msg.abort_all, msg.message or "aborted")

    def _on_flush(self, msg: FlushCacheReqInput) -> FlushCacheReqOutput:
        busy = bool(
            self.running or self.waiting or self.chunked or self.grammars or self.embeds.num_waiting
        )
        if not busy:
            self.cache.reset()  # what open sessions pin stays (their next turns need it)
        return FlushCacheReqOutput(
            success=not busy, message="requests are running; retry when idle" if busy else ""
        )

    def _on_open_session(self, msg: OpenSessionReqInput) -> OpenSessionReqOutput:
        return self.sessions.open(msg)

    def _on_close_session(self, msg: CloseSessionReqInput) -> CloseSessionReqOutput:
        if self.sessions.close(msg.session_id):
            return CloseSessionReqOutput(success=True)
        return CloseSessionReqOutput(success=False, message=f"no open session {msg.session_id!r}")

    def _on_pause(self, msg: PauseGenerationReqInput) -> None:
        if msg.mode == "abort":
            self.abort(abort_all=True, message="generation paused")
        elif msg.mode == "retract":
            self.retract_all()
        self.is_paused = True

    def _on_continue(self, msg: ContinueGenerationReqInput) -> None:
        self.is_paused = False

    def _on_get_load(self, msg: GetLoadReqInput) -> GetLoadReqOutput:
        used = self.num_used_tokens()
        total = self.allocator.num_pages * self.allocator.page_size
        return GetLoadReqOutput(
            dp_rank=0,
            num_running_reqs=len(self.running) + (1 if self.chunked else 0),
            num_waiting_reqs=len(self.waiting) + len(self.grammars or ()) + self.embeds.num_waiting,
            num_used_tokens=used,
            num_cached_tokens=self.cache.num_cached_pages * self.allocator.page_size,
            max_total_num_tokens=total,
            token_usage=used / total if total else 0.0,
            gen_throughput=self.throughput(),
            cache_hit_rate=self.cache_hit_rate(),
        )

    def _on_profile(self, msg: ProfileReq) -> ProfileReqOutput:
        if msg.action == "start":
            ok, message = self.profiler.start(msg.output_dir, msg.num_steps, msg.start_step)
        else:
            ok, message = self.profiler.stop()
        return ProfileReqOutput(success=ok, message=message)

    def _on_update_weights(
        self, msg: UpdateWeightFromDiskReqInput
    ) -> UpdateWeightFromDiskReqOutput:
        try:
            path = self.runner.load_weights(msg.model_path, msg.load_format)
        except Exception as e:  # the server keeps its old weights and says why
            return UpdateWeightFromDiskReqOutput(success=False, message=str(e))
        # Cached KV was computed by the old weights: none of it may be matched again.
        self.sessions.unpin_all()
        self.cache.reset()
        return UpdateWeightFromDiskReqOutput(success=True, message=f"loaded weights from {path}")

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        try:
            if req.params.seed is not None:
                req.generator = self.runner.make_generator(req.params.seed)
        except Exception as e:
            return self.fail(req, e, "seeding its random generator")
        if req.session_params is not None:
            try:
                self.sessions.attach(req, req.session_params)
            except SessionError as e:
                reason = {"type": "abort", "status_code": 400, "param": "session_params"}
                return self._end(req, {**reason, "message": str(e)})
            if not self._fit_session_prompt(req):
                return
        need = self.allocator.pages_for(req.total_tokens_needed(self.context_len))
        if need > self.allocator.num_pages:  # the front refuses these; never wait for ever
            return self.fail(
                req,
                RuntimeError(f"it needs {need} KV pages, the pool has {self.allocator.num_pages}"),
                "being admitted",
            )
        key = grammar_key(req.params)
        if key is not None and req.grammar is None:
            if self.grammars is None:  # the front refuses these when no engine runs
                return self.fail(req, RuntimeError("no grammar engine runs"), "being admitted")
            return self.grammars.submit(req, key)  # joins the queue once compiled
        self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        if self.args.enable_priority_scheduling:
            self._enqueue_by_priority(req)
        else:
            self.waiting.append(req)

    def _take_compiled(self) -> None:
        """Requests whose grammar is compiled join the waiting queue with it; one whose
        grammar failed to compile ends (a 400: the constraint is the request's own)."""
        for req, grammar in self.grammars.ready():
            if isinstance(grammar, ValueError):  # InvalidGrammar, or its timeout
                self._end(req, {"type": "abort", "status_code": 400, "message": str(grammar)})
            elif isinstance(grammar, BaseException):
                self.fail(req, grammar, "compiling its grammar")
            else:
                req.grammar = grammar
                self._enqueue(req)

    def _enqueue_by_priority(self, req: Req) -> None:
        """Behind every waiting request of the same or a higher priority (higher values first,
        or lower with --schedule-low-priority-values-first; no priority is the lowest)."""
        rank = self._priority_rank(req)
        for i, other in enumerate(self.waiting):
            if self._priority_rank(other) < rank:
                self.waiting.insert(i, req)
                return
        self.waiting.append(req)

    def _fit_session_prompt(self, req: Req) -> bool:
        """A session's history plus the new input must leave room for one token; generation
        is cut at the context length (SGLang's rule). Ends the request when it cannot."""
        num = len(req.input_ids)
        if num >= self.context_len:
            self._end(
                req,
                {
                    "type": "abort",
                    "status_code": 400,
                    "param": "session_params",
                    "message": f"the session's history plus this input is {num} tokens, at "
                    f"least the context length ({self.context_len}); start a new session",
                },
            )
            return False
        if num + req.params.max_new_tokens > self.context_len:
            req.params.max_new_tokens = self.context_len - num
        return True

    def _priority_rank(self, req: Req) -> float:
        if req.priority is None:
            return float("-inf")
        return -req.priority if self.args.schedule_low_priority_values_first else req.priority

    def abort(
        self, rid: str | None = None, abort_all: bool = False, message: str = "aborted"
    ) -> None:
        """Ends the request(s) now, releasing their KV pages; unknown rids are ignored. A rid
        also names the samples f"{rid}-{j}" of an n > 1 request (whichever front process
        sent them: an abort may arrive through another front than the request)."""
        for req in self._live():
            if abort_all or req.rid == rid or _is_sample_of(req.rid, rid):
                self._end(req, {"type": "abort", "message": message})
        self.outputs.extend(self.embeds.abort(rid, abort_all, message))

    def fail(self, req: Req, error: BaseException, stage: str) -> None:
        """Ends `req` with an internal error caused by the request itself (a 500 that a router
        must not retry elsewhere), frees what it holds, and leaves every other request alone."""
        logger.error(
            "request %s failed while %s; it ends with an error, the batch goes on",
            req.rid,
            stage,
            exc_info=error,
        )
        self.num_failed_requests += 1
        self._end(
            req,
            {
                "type": "abort",
                "status_code": 500,
                "request_fault": True,
                "message": f"internal error while {stage}: {type(error).__name__}: {error}",
            },
        )

    def fail_rid(self, rid: str, error: BaseException, stage: str) -> None:
        """`fail` for the live request `rid`, if there is one."""
        for req in self._live():
            if req.rid == rid:
                return self.fail(req, error, stage)

    def retract_all(self) -> None:
        """Moves every admitted request back to the front of the queue, freeing its KV (what
        it computed stays in the prefix cache, so taking it back in is cheap)."""
        admitted = ([self.chunked] if self.chunked else []) + self.running
        self.chunked, self.running = None, []
        for req in reversed(admitted):
            self.kv.cache_progress(req)
            self.kv.release(req)
            req.num_computed = 0
            self.waiting.appendleft(req)

    def _live(self) -> list[Req]:
        compiling = self.grammars.owners if self.grammars else []
        return [*compiling, *self.waiting, *([self.chunked] if self.chunked else []), *self.running]

    # ---- the loop body ---------------------------------------------------------------------

    def step_tokens_bound(self) -> int:
        """At most how many tokens the next step computes (for the watchdog's patience)."""
        if self.waiting or self.chunked is not None:
            return self.args.chunked_prefill_size + len(self.running)
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return not self.is_paused and bool(
            self.waiting or self.running or self.chunked or self.grammars or self.embeds.num_waiting
        )

    def step(self) -> list[ReqOutput]:
        """One scheduling round. Returns the outputs produced since the last call."""
        self.sessions.reap(time.monotonic())
        if self.embeds.num_waiting and not self.is_paused:
            self.outputs.extend(self.embeds.step())
        if self.grammars:
            self._take_compiled()
        batch, reqs = self._schedule()
        if batch is not None:
            self._postprocess(batch, reqs, self.runner.run(batch))
        elif self.grammars and not self.outputs:
            self.grammars.wait(GRAMMAR_POLL_S)  # nothing runs: wait for a compile, briefly
        if not self.running:
            self.runner.release_decode_state()
        outputs, self.outputs = self.outputs, []
        return outputs

    def _schedule(self) -> tuple[ScheduleBatch | None, list[Req]]:
        """Prefill first (the unfinished chunk, then new requests while memory and the token
        budget allow); otherwise one decode step of every running request. Returns the batch
        and its requests, item for item."""
        if self.is_paused:
            return None, []
        new_pages: list[int] = []
        extend = self._schedule_extend()
        if extend:
            reqs = [req for req, _ in extend]
            items = [self._extend_item(req, n, new_pages) for req, n in extend]
        elif self.running:
            reqs = list(self.running)
            items = [self._decode_item(req, new_pages) for req in reqs]
        else:
            return None, []
        batch = ScheduleBatch(is_decode=not extend, items=items, new_pages=new_pages)
        self._prepare_sampling(batch, reqs)
        if not batch.items:
            return None, []
        hooks.notify(
            hooks.batch_scheduled,
            hooks.BatchInfo(
                not batch.is_decode, tuple(i.rid for i in batch.items), batch.num_tokens
            ),
        )
        return batch, reqs

    def _outstanding_pages(self) -> int:
        admitted = self.running + ([self.chunked] if self.chunked else [])
        return sum(r.num_reserved_pages - len(r.pages) for r in admitted)

    def _schedule_extend(self) -> list[tuple[Req, int]]:
        budget = self.args.chunked_prefill_size
        chosen: list[tuple[Req, int]] = []
        claimed: set[int] = set()  # pages (by chained hash) this round's prefill computes
        if self.chunked is not None:
            req = self.chunked
            n = min(len(req.fill_ids) - req.num_computed, budget)
            chosen.append((req, n))
            budget -= n
            self.kv.claim(req, req.num_computed + n, claimed)
        # Pages free for new reservations (those of admitted requests are spoken for).
        free = self.allocator.num_free_pages - self._outstanding_pages()
        for req in self._admission_order():
            if budget <= 0 or len(self.running) + len(chosen) >= self.args.max_running_requests:
                break
            pages, node = self.kv.match(req)
            if self.kv.shares_claimed(req, len(pages), claimed):
                continue  # takes the pages another request computes now from the cache next round
            self.cache.lock(node)  # before counting: its pages are not evictable any more
            need = self.allocator.pages_for(req.total_tokens_needed(self.context_len)) - len(pages)
            while need > free + self.cache.num_evictable_pages:
                idle = not (self.running or self.chunked or chosen)
                if not (idle and self.sessions.unpin_lru()):  # pins yield only to a stall
                    break
            if need > free + self.cache.num_evictable_pages:
                self.cache.unlock(node)
                break  # waits for memory; nothing behind it jumps the queue
            if need > free:
                self.cache.evict(need - free)
            free -= need
            self._admit(req, pages, node, need)
            n = min(len(req.fill_ids) - req.num_computed, budget)
            chosen.append((req, n))
            budget -= n
            self.kv.claim(req, req.num_computed + n, claimed)
            if req.num_computed + n < len(req.fill_ids):
                self.chunked = req
        return chosen

    def _admission_order(self) -> list[Req]:
        """Waiting requests in the order admission considers them: arrival (or priority)
        order; with lpm, longest cached prefix first within a priority."""
        if not self.waiting:
            return []
        order = list(self.waiting)
        if self.lpm and 1 < len(order) <= LPM_MAX_WAITING:
            if self.args.enable_priority_scheduling:
                order.sort(key=lambda r: (-self._priority_rank(r), -self.kv.match_len(r)))
            else:
                order.sort(key=lambda r: -self.kv.match_len(r))
        return order

    def _admit(self, req: Req, pages: list[int], node, need: int) -> None:
        """`req` takes its cached prefix (`pages`, `node` already locked) and reserves `need`
        more pages for everything else it can ever hold."""
        self.waiting.remove(req)
        if pages:
            self.allocator.incref(pages)
        req.pages, req.cache_node = list(pages), node
        req.num_computed = len(pages) * self.allocator.page_size
        req.num_reserved_pages = len(pages) + need
        req.is_admitted = True
        if req.match_at != -2:  # first admission (a retracted request is not counted again)
            req.cached_tokens = req.num_computed
            self.num_prompt_tokens += len(req.input_ids)
            self.num_cache_hit_tokens += req.num_computed
            req.match_at = -2

    def _extend_item(self, req: Req, n: int, new_pages: list[int]) -> BatchItem:
        start = req.num_computed
        self.kv.grow(req, start + n, new_pages)
        item = BatchItem(
            req.rid,
            req.uid,
            req.fill_ids[start : start + n],
            start,
            req.pages,
            top_logprobs_num=req.top_logprobs_num,
            token_ids_logprob=req.token_ids_logprob,
            return_hidden_states=req.return_hidden_states,
        )
        if req.wants_input_logprobs:
            # Rows whose logits give the logprob of the following prompt token.
            first = max(req.logprob_start_len, 1) - 1
            last = min(start + n - 1, len(req.input_ids) - 2)
            item.logprob_rows = [p - start for p in range(max(start, first), last + 1)]
            item.logprob_targets = req.input_ids[max(start, first) + 1 : last + 2]
        return item

    def _decode_item(self, req: Req, new_pages: list[int]) -> BatchItem:
        self.kv.grow(req, req.seq_len, new_pages)
        return BatchItem(
            req.rid,
            req.uid,
            [req.output_ids[-1]],
            req.seq_len - 1,
            req.pages,
            return_hidden_states=req.return_hidden_states,
        )

    def _prepare_sampling(self, batch: ScheduleBatch, reqs: list[Req]) -> None:
        """The sampling input of every item that samples this step: a decode, or the last
        chunk of a prefill (unless the request wants no new token at all). A request that
        fails here leaves the batch before it runs (its pages are free again)."""
        for i in reversed(range(len(reqs))):
            item, req = batch.items[i], reqs[i]
            done = item.start + len(item.token_ids) == len(req.fill_ids)
            if not (batch.is_decode or done) or req.params.max_new_tokens == 0:
                continue
            try:
                item.sampling = SamplingInput(
                    req.params,
                    req.input_ids,
                    req.output_ids,
                    req.generator,
                    self.stops.suppressed_ids(req),
                    req.top_logprobs_num,
                    req.token_ids_logprob,
                    req.return_logprob,
                    req.logit_processor,
                    req.grammar,
                )
            except Exception as e:
                self.fail(req, e, "preparing its sampling")
                del batch.items[i], reqs[i]

    # ---- after the forward pass ---------------------------------------------------------------

    def _postprocess(
        self, batch: ScheduleBatch, reqs: list[Req], results: list[ItemResult]
    ) -> None:
        for item, req, result in zip(batch.items, reqs, results):
            try:
                self._apply(batch, item, req, result)
            except Exception as e:
                self.fail(req, e, "checking its stop conditions")
        self.profiler.on_step()

    def _apply(self, batch: ScheduleBatch, item: BatchItem, req: Req, result: ItemResult) -> None:
        if result.error is not None:
            return self.fail(req, result.error, result.error_stage)
        if item.logprob_rows:
            self._record_input_logprobs(req, result)
        if result.hidden_states:
            self._record_hidden_states(req, item.start, result.hidden_states)
        req.num_computed = item.start + len(item.token_ids)
        if not batch.is_decode:
            self.kv.cache_progress(req)
            if req.num_computed < len(req.fill_ids):
                return  # more chunks to come
            if self.chunked is req:
                self.chunked = None
            if req.params.max_new_tokens == 0:
                return self._end(req, {"type": "length", "length": 0})
            self.running.append(req)
        if result.next_id is None:
            return
        self._throughput_window.append((time.monotonic(), 1))
        self.num_generated_tokens += 1
        req.output_ids.append(result.next_id)
        if req.return_logprob:
            req.pending_logprobs.append((result.logprob, result.next_id))
            req.pending_top.append(result.top_logprobs)
            req.pending_given.append(result.token_ids_logprobs)
        if req.grammar is not None and not req.grammar.accept(result.next_id):
            if req.grammar.allows_nothing():
                req.output_ids.pop()  # drawn from a row with nothing allowed: not an output
                return self._end(req, self._dead_end_reason(req))
            raise RuntimeError(f"its grammar refused the token {result.next_id} it sampled")
        reason = self.stops.check(req, result.next_id)
        if reason is None and req.grammar is not None and req.grammar.is_terminated():
            reason = {"type": "stop", "matched": result.next_id}  # the grammar is complete
        if reason is not None:
            self._end(req, reason)
        elif req.stream and (
            req.num_sent == 0 or len(req.output_ids) - req.num_sent >= self.args.stream_interval
        ):
            self.outputs.append(self._output(req))  # the first token at once, then every K

    @staticmethod
    def _dead_end_reason(req: Req) -> dict:
        """The request's constraint allows no next token (a schema with no finite value that
        the edge could not see, e.g. a $ref cycle reached after a few tokens): the client's
        own constraint is at fault, a 400 naming it."""
        key = grammar_key(req.params)
        field = key.field if key is not None else "json_schema"
        return {
            "type": "abort",
            "status_code": 400,
            "param": field,
            "message": f"{field}: the constraint allows no token after {len(req.output_ids)} "
            "tokens of output: it admits no complete value (does a $ref refer to itself "
            "with nothing else to match?)",
        }

    @staticmethod
    def _record_hidden_states(req: Req, start: int, states: list[list[float]]) -> None:
        """Keeps the hidden states of positions not recorded yet (a retracted request
        computes its earlier positions again)."""
        skip = max(req.num_hidden_positions - start, 0)
        req.pending_hidden.extend(states[skip:])
        req.num_hidden_positions = max(req.num_hidden_positions, start + len(states))

    def _record_input_logprobs(self, req: Req, result: ItemResult) -> None:
        if req.input_logprobs is None:
            req.input_logprobs, req.input_top, req.input_given = [], [], []
            if req.logprob_start_len == 0:  # the first prompt token: nothing predicts it
                req.input_logprobs.append((None, req.input_ids[0]))
                req.input_top.append([])
                req.input_given.append([])
        req.input_logprobs.extend(result.input_logprobs)
        req.input_top.extend(result.input_top)
        req.input_given.extend(result.input_given)

    # ---- endings ---------------------------------------------------------------------------------

    def _end(self, req: Req, reason: dict) -> None:
        """Finishes `req` wherever it is (waiting, prefilling, running) and emits its last output.
        What it computed stays in the prefix cache, unless it failed (its KV is suspect)."""
        req.finished_reason = reason
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        if self.grammars:
            self.grammars.discard(req)
        ok = not reason.get("request_fault")
        if ok and req.is_admitted:
            self.kv.cache_progress(req)
        self.sessions.on_end(req, req.cache_node, ok)
        self.kv.release(req)
        self.outputs.append(self._output(req))

    def _output(self, req: Req) -> ReqOutput:
        new_ids = req.output_ids[req.num_sent :]
        req.num_sent = len(req.output_ids)
        out = ReqOutput(
            req.rid,
            new_ids,
            req.finished_reason,
            len(req.input_ids),
            len(req.output_ids),
            req.cached_tokens,
            req.http_worker_ipc,
            req.params,
            req.return_logprob,
        )
        if req.pending_hidden:
            out.hidden_states, req.pending_hidden = req.pending_hidden, []
        if req.return_logprob:
            out.output_logprobs, req.pending_logprobs = req.pending_logprobs, []
            out.output_top_logprobs, req.pending_top = req.pending_top, []
            out.output_token_ids_logprobs, req.pending_given = req.pending_given, []
            if not req.input_logprobs_sent and (
                req.input_logprobs is not None or req.is_finished or new_ids
            ):
                out.input_logprobs = req.input_logprobs or []
                out.input_top_logprobs = req.input_top or []
                out.input_token_ids_logprobs = req.input_given or []
                req.input_logprobs_sent = True
        return out

    # ---- state for /get_load, /v1/loads and tests --------------------------------------------

    def num_used_tokens(self) -> int:
        """KV tokens held by live requests and pinned sessions (evictable cache not counted)."""
        alloc = self.allocator
        in_use = alloc.num_pages - alloc.num_free_pages - self.cache.num_evictable_pages
        return in_use * alloc.page_size

    def cache_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served from the prefix cache, since start."""
        if not self.num_prompt_tokens:
            return 0.0
        return self.num_cache_hit_tokens / self.num_prompt_tokens

    def throughput(self) -> float:
        window = self._throughput_window
        if len(window) < 2 or time.monotonic() - window[-1][0] > 5:
            return 0.0
        span = window[-1][0] - window[0][0]
        return sum(n for _, n in list(window)[1:]) / span if span > 0 else 0.0
