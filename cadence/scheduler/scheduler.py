"""The scheduler core: `handle(msg)` for every message, `step()` for the loop.

One core serves both the scheduler process (`scheduler/process.py`, over ZMQ) and the
in-process `Engine` (on a thread): every request and control message goes through one
dispatch table (the control messages' answers are the control desk's, `control.py`), and a
step is schedule -> run -> postprocess.

KV memory is the KV manager's (`mem_cache/kv_manager.py`): admission (`admission.py`) asks
it to reserve every page a request can ever need, with its cached prefix; a request grows
into its reservation step by step, its computed whole pages go into the prefix cache after
every prefill chunk and when it ends, and it releases the rest then, so what it computed
stays cached (evictable) until memory is needed. The scheduler never holds the allocator
or the cache.

Single-threaded by design: only the thread that calls `handle` and `step` touches requests,
KV pages or queues. The scheduler asks the KV manager for pages and the runner to run a
batch; it never touches model internals. Requests arrive checked by the front and are
trusted.

Failures are isolated per request: an exception while admitting, preparing, sampling,
computing logprobs or checking the stop conditions of one request fails that request alone
(a 500 marked as caused by the request, its KV pages freed) and the batch goes on. Only the
model forward itself, which every request in the batch shares, may raise out of `step()`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from cadence import hooks
from cadence.constrained import grammar_key
from cadence.constrained.grammar_queue import GrammarQueue
from cadence.disaggregation.messages import Done
from cadence.io_struct import (
    REPLY_TYPES,
    AbortReq,
    BatchTokenizedEmbeddingReqInput,
    GetLoadReqInput,
    GetWeightVersionReqInput,
    LoRAUpdateOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from cadence.mem_cache.kv_events import KVEventPublisher, KVEventsConfig
from cadence.mem_cache.kv_manager import KVManager
from cadence.model_executor.lora_manager import NOT_ENABLED as LORA_NOT_ENABLED
from cadence.model_executor.runner import BatchItem, ItemResult, Launched, Runner, ScheduleBatch
from cadence.scheduler.admission import Admission
from cadence.scheduler.batch import ahead_batch, decode_item, extend_item, prepare_sampling
from cadence.scheduler.control import ControlDesk
from cadence.scheduler.disaggregation import DecodeIntake, PrefillHandoff, transfer_failed
from cadence.scheduler.embedding import EmbeddingQueue, EmbedOutput, embed_req_from_tokenized
from cadence.scheduler.profiler import Profiler
from cadence.scheduler.req import Req, ReqOutput, is_sample_of, req_from_tokenized
from cadence.scheduler.sessions import SessionController, SessionError, auto_bos
from cadence.scheduler.speculative import Speculation
from cadence.scheduler.stop_checker import StopChecker, dead_end_reason
from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)

# With nothing else to run, the loop waits this long at most for a grammar to compile.
GRAMMAR_POLL_S = 0.005
# Messages handled while a step is in flight; any other first waits for it (Scheduler.handle).
NO_DRAIN_TYPES = (
    TokenizedGenerateReqInput,
    TokenizedEmbeddingReqInput,
    BatchTokenizedEmbeddingReqInput,
    AbortReq,
    GetLoadReqInput,
    GetWeightVersionReqInput,
)


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        runner: Runner,
        kv: KVManager,
        stop_checker: StopChecker,
        grammars: GrammarQueue | None = None,
        pd: PrefillHandoff | DecodeIntake | None = None,
    ):
        self.args = args
        self.runner = runner
        self.kv = kv  # every KV page this scheduler's requests hold, through one book
        self.stops = stop_checker
        # Requests whose constraint is compiling wait here, outside the waiting queue.
        self.grammars = grammars
        # Prefill/decode disaggregation: this server's half of requests with a room.
        self.pd = pd
        self.context_len = runner.context_len
        self.running: list[Req] = []  # prefill complete, decoding
        self.chunked: Req | None = None  # admitted, prefill in progress
        # Launched decodes whose tokens are not back yet, oldest first, each with its requests
        # row by row: the overlap schedule's one step on the device, or with pipeline stages
        # one lane per stage (see step).
        self.inflight: deque[tuple[Launched, list[Req]]] = deque()
        self._decode_turns = 0  # decode items scheduled (Req.decode_turn)
        # Requests queued or ended so far, and that count when admission last took nothing
        # from a non-empty queue: until it moves, the queue cannot move either.
        self._queue_changes = 0
        self._stuck_at = -1
        self.is_paused = False
        self.weight_version = args.weight_version  # of the weights served (outputs carry it)
        self.outputs: list[ReqOutput | EmbedOutput] = []  # since the last step (`to_messages`)
        self.num_generated_tokens = 0
        self.num_failed_requests = 0  # requests ended by an error of their own (see `fail`)
        self._throughput_window: deque[tuple[float, int]] = deque(maxlen=64)
        self._num_decode_steps = 0  # for --decode-log-interval
        self._init_collaborators()
        self._handlers = self._dispatch_table()

    def _init_collaborators(self) -> None:
        args, runner = self.args, self.runner
        self.sessions = SessionController(
            self.kv,
            lambda req, why: self._end(req, {"type": "abort", "message": why}),
            auto_bos(getattr(self.stops, "tokenizer", None)),
            args.effective_session_timeout_s,
        )
        self.admission = Admission(self.kv, args, self.context_len, self._relieve_memory)
        # Embedding requests: one forward pass per input, in steps of at most the prefill budget.
        self.embeds = EmbeddingQueue(runner, self.kv, args.prefill_token_budget(self.context_len))
        self.profiler = Profiler(args.effective_profile_dir, runner.profiler_activities)
        self.spec = (
            Speculation(args, self.context_len) if args.speculative_algorithm is not None else None
        )
        # KV-cache events for routers (--kv-events-config): published after every step.
        config = KVEventsConfig.parse(args.kv_events_config)
        self.kv_events = KVEventPublisher(config) if config is not None else None

    def _dispatch_table(self) -> dict[type, Callable[[Any], Any]]:
        return {
            TokenizedGenerateReqInput: self._on_generate,
            TokenizedEmbeddingReqInput: self._on_embed,
            BatchTokenizedEmbeddingReqInput: self._on_embed_batch,
            AbortReq: self._on_abort,
            **ControlDesk(self).handlers(),  # flush, pause, load, profile, weights, ...
        }

    @property
    def waiting(self) -> deque[Req]:
        """Requests waiting for admission, in the order they are considered."""
        return self.admission.waiting

    # ---- messages in ---------------------------------------------------------------------

    def handle(self, msg):
        """Handles one message; returns the answer its sender waits for, or None. A message
        that fails is answered with a failure (a request: its own error), never raised.
        A control message that may change running requests or the KV (pause, flush, weights,
        sessions, ...) first waits for the step in flight and applies it."""
        if self.inflight and type(msg) not in NO_DRAIN_TYPES:
            self.drain()
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.error("the scheduler got an unexpected %s", type(msg).__name__)
            return None
        try:
            reply = handler(msg)
        except Exception as e:
            logger.exception("handling %s failed", type(msg).__name__)
            reply = self._on_handler_error(msg, e)
        if reply is not None:  # it goes back to the front that asked, to the caller that asked
            reply.http_worker_ipc = msg.http_worker_ipc
            reply.cid = msg.cid
        self.publish_kv_events()  # a flush, an abort: subscribers learn it now
        return reply

    def _on_handler_error(self, msg, e: Exception):
        """A request that failed to be queued fails alone; a control message is answered."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self.fail(req_from_tokenized(msg), e, "being admitted")
        elif isinstance(msg, TokenizedEmbeddingReqInput | BatchTokenizedEmbeddingReqInput):
            self.outputs.extend(self.embeds.fail_message(msg, e))
        elif type(msg) in REPLY_TYPES:
            why = f"internal error: {type(e).__name__}: {e}"
            if REPLY_TYPES[type(msg)] is LoRAUpdateOutput:
                return LoRAUpdateOutput(success=False, error_message=why)
            return REPLY_TYPES[type(msg)](success=False, message=why)
        return None

    def _on_generate(self, msg: TokenizedGenerateReqInput) -> None:
        self.add_request(req_from_tokenized(msg))

    def _on_embed(self, msg: TokenizedEmbeddingReqInput) -> None:
        self.embeds.add([embed_req_from_tokenized(msg)])

    def _on_embed_batch(self, msg: BatchTokenizedEmbeddingReqInput) -> None:
        self.embeds.add([embed_req_from_tokenized(item) for item in msg.batch])  # all or none

    def _on_abort(self, msg: AbortReq) -> None:
        self.abort(msg.rid, msg.abort_all, msg.message or "aborted")

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        try:
            if req.params.seed is not None:
                req.generator = self.runner.make_generator(req.params.seed)
        except Exception as e:
            return self.fail(req, e, "seeding its random generator")
        if req.lora_name is not None and not self._take_lora(req):
            return None
        if req.session_params is not None:
            try:
                self.sessions.attach(req, req.session_params)
            except SessionError as e:
                reason = {"type": "abort", "status_code": 400, "param": "session_params"}
                return self._end(req, {**reason, "message": str(e)})
            refusal = self.sessions.fit_prompt(req, self.context_len)
            if refusal is not None:
                return self._end(req, refusal)
        need = self.kv.pages_for(req.total_tokens_needed(self.context_len))
        if need > self.kv.num_pages:  # the front refuses these; never wait for ever
            error = RuntimeError(f"it needs {need} KV pages, the pool has {self.kv.num_pages}")
            return self.fail(req, error, "being admitted")
        key = grammar_key(req.params)
        if key is not None and req.grammar is None:
            if self.grammars is None:  # the front refuses these when no engine runs
                return self.fail(req, RuntimeError("no grammar engine runs"), "being admitted")
            return self.grammars.submit(req, key)  # joins the queue once compiled
        self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        """`req` waits for admission; a decode server's half of a disaggregated request waits
        for its pages in the PD intake instead (it is never prefilled here)."""
        if self.pd is not None and req.bootstrap is not None and req.params.max_new_tokens > 0:
            refusal = self.pd.add(req)
            if refusal is not None:
                reason = {"type": "abort", "status_code": 400, "param": "bootstrap_room"}
                return self._end(req, {**reason, "message": refusal})
            if isinstance(self.pd, DecodeIntake):
                return None
        elif isinstance(self.pd, DecodeIntake) and req.bootstrap is not None:
            # Nothing to generate: the prefill side answers the prompt's logprobs.
            return self._end(req, {"type": "length", "length": 0})
        self.admission.enqueue(req)
        self._queue_changes += 1

    def _take_lora(self, req: Req) -> bool:
        """`req` holds its adapter until it ends; False (and it ended, a 400) when that
        adapter is not loaded (unloaded since the front checked the name)."""
        try:
            if self.runner.lora is None:
                raise KeyError(req.lora_name)
            req.lora = self.runner.lora.acquire(req.lora_name)
        except KeyError:
            why = LORA_NOT_ENABLED if self.runner.lora is None else "it is not loaded"
            message = f"LoRA adapter {req.lora_name!r} cannot serve this request: {why}"
            reason = {"type": "abort", "status_code": 400, "param": "lora_path"}
            self._end(req, {**reason, "message": message})
            return False
        req.lora_uid = req.lora.uid
        return True

    def _take_compiled(self, grammars: GrammarQueue) -> None:
        """Requests whose grammar is compiled join the waiting queue with it; one whose
        grammar failed to compile ends (a 400: the constraint is the request's own)."""
        for req, grammar in grammars.ready():
            if isinstance(grammar, ValueError):  # InvalidGrammar, or its timeout
                self._end(req, {"type": "abort", "status_code": 400, "message": str(grammar)})
            elif isinstance(grammar, BaseException):
                self.fail(req, grammar, "compiling its grammar")
            else:
                req.grammar = grammar
                self._enqueue(req)

    def _relieve_memory(self) -> bool:
        """Admission is stalled with nothing running: pinned session KV yields, least
        recently active session first. True when something was unpinned."""
        return self.sessions.unpin_lru()

    def abort(
        self, rid: str | None = None, abort_all: bool = False, message: str = "aborted"
    ) -> None:
        """Ends the request(s) now, releasing their KV pages; unknown rids are ignored. A rid
        also names the samples f"{rid}-{j}" of an n > 1 request (whichever front process
        sent them: an abort may arrive through another front than the request)."""
        for req in self._live():
            if abort_all or req.rid == rid or is_sample_of(req.rid, rid):
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
            self._cache_progress(req)
            self._release(req)
            req.num_computed = 0
            self.admission.requeue(req)

    def _live(self) -> list[Req]:
        compiling = self.grammars.owners if self.grammars else []
        pd = self.pd.waiting if self.pd is not None else []
        chunked = [self.chunked] if self.chunked else []
        return [*compiling, *self.waiting, *pd, *chunked, *self.running]

    # ---- the loop body ---------------------------------------------------------------------

    def step_tokens_bound(self) -> int:
        """At most how many tokens the next step computes (for the watchdog's patience)."""
        if self.waiting or self.chunked is not None:
            return self.admission.chunk_size + len(self.running)
        return len(self.running)

    @property
    def has_work(self) -> bool:
        pd = self.pd
        if pd is not None and (pd.agent.has_events or (pd.has_work and not self.is_paused)):
            return True
        return bool(self.inflight) or (
            not self.is_paused
            and bool(
                self.waiting
                or self.running
                or self.chunked
                or self.grammars
                or self.embeds.num_waiting
            )
        )

    def step(self) -> list[ReqOutput | EmbedOutput]:
        """One scheduling round. Returns the outputs produced since the last call."""
        self.sessions.reap(time.monotonic())
        if self.embeds.num_waiting and not self.is_paused:
            self.drain()  # the runner takes no other step while one is in flight
            self.outputs.extend(self.embeds.step())
        if self.grammars:
            self._take_compiled(self.grammars)
        if self.pd is not None:
            self._step_disaggregation(self.pd)
        if not self.inflight:
            self._step_now()
        elif self.runner.decode_lanes > 1:
            self._step_lanes()
        else:
            self._step_ahead()
        if not self.running and not self.inflight:
            self.runner.release_decode_state()
        self.publish_kv_events()
        outputs, self.outputs = self.outputs, []
        return outputs

    def _step_disaggregation(self, pd: PrefillHandoff | DecodeIntake) -> None:
        """What the transfer agent reports: prefill requests whose decode side has all (they
        answer now) or failed; decode requests whose pages arrived (they join the batch) or
        failed; then decode requests that wait for pages try to get them."""
        if isinstance(pd, PrefillHandoff):
            for req, reason in pd.take_endings():
                self._end(req, reason)
            return
        ready, lost = pd.take_news()
        for req, why in lost:
            self._end(req, transfer_failed(why))
        if ready and self.inflight:
            self.drain()  # the step in flight decodes only its own requests
        for req, done in ready:
            self._join(req, done)
        if not self.is_paused:
            pd.admit()

    def _join(self, req: Req, done: Done) -> None:
        """A decode server's request whose prompt K/V arrived goes on from its first token,
        sampled by the prefill server, as if it had sampled it here."""
        req.num_computed = len(req.input_ids)
        req.cached_tokens = done.cached_tokens  # SGLang reports the prefill side's hits
        if done.token is None:
            return self._end(req, {"type": "length", "length": 0})
        self.running.append(req)
        try:
            if req.generator is not None and not req.params.is_greedy:
                self.runner.skip_draws(req.generator, 1)  # what the first token drew there
            result = ItemResult(done.token, done.logprob, done.top, done.given)
            self._take_token(req, result)
        except Exception as e:
            self.fail(req, e, "taking its first token from the prefill server")

    def publish_kv_events(self) -> None:
        """What the prefix cache stored and dropped since the last call, to subscribers."""
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.take_kv_events())

    def close(self) -> None:
        if self.pd is not None:
            self.pd.agent.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        self.kv.close()
        self.runner.close()

    def _step_now(self) -> None:
        batch, reqs = self._schedule()
        if batch is None:
            if self.grammars and not self.outputs:
                self.grammars.wait(GRAMMAR_POLL_S)  # nothing runs: wait for a compile, briefly
            return
        started = time.perf_counter()
        # Speculative decoding drafts from each step's tokens on the host: a step with drafts
        # runs now; one without may fly, and steps go ahead of it for a while (`_step_ahead`).
        drafted = self.spec is not None and any(item.num_draft for item in batch.items)
        if self.spec is not None and batch.is_decode:
            self.spec.looked(drafted)
        launched = Launched(batch, self.runner.run(batch)) if drafted else self.runner.launch(batch)
        if launched.results is None:  # in flight: its tokens come in a later step
            self.inflight.append((launched, reqs))
            return
        results = launched.results
        if batch.is_decode and self.spec is not None:  # what a step of this size costs
            verified = any(item.num_draft for item in batch.items)
            emitted = sum(1 + len(r.more) for r in results if r.error is None)
            seconds = time.perf_counter() - started
            self.spec.cost.observe(batch.num_tokens, seconds, verified, len(batch.items), emitted)
        self._postprocess(batch, reqs, results)

    def _step_ahead(self) -> None:
        """Overlap scheduling: step N is on the device. Launch step N+1 (the same requests,
        each decoding the token N samples for it, read on the device) when nothing else
        wants the next step (no request waits for admission, nothing is paused), then take
        N's tokens, so the host's work on N and on N+1 runs while the device computes."""
        _, reqs = self.inflight[0]
        ahead = None
        if not (
            self.is_paused
            or self.waiting
            or self.chunked
            or self.embeds.num_waiting
            or (self.spec is not None and not self.spec.may_step_ahead())
        ):
            ahead = ahead_batch(self.kv, reqs, self.context_len)
        if ahead is None:
            return self.drain()
        batch, ahead_reqs = ahead
        self._notify_scheduled(batch)
        nxt = self.runner.launch(batch)
        self.drain()  # N's tokens, while N+1 runs
        if nxt.results is None:
            self.inflight.append((nxt, ahead_reqs))
        else:  # the runner ran it at once: applied in order, after N
            self._postprocess(batch, ahead_reqs, nxt.results)

    def _step_lanes(self) -> None:
        """Pipeline stages: lanes of disjoint running requests are in flight together, so
        that while a later stage runs one lane the first stage runs the next (and samples,
        and schedules). Launch a lane of the running requests that are not in flight (an
        even share of them over the lanes still free); once every lane flies, or nothing
        is left to launch, take the oldest lane's tokens. Anything but a decode (a prompt
        to admit, a pause, embeddings) first takes every lane back; the lanes are cut
        afresh after it. A prompt that waits for memory (admission took nothing, and no
        request came or ended since) leaves the lanes flying."""
        admits = self.waiting and self._stuck_at != self._queue_changes
        if self.is_paused or admits or self.chunked or self.embeds.num_waiting:
            return self.drain()
        lanes = self.runner.decode_lanes
        flying = {id(req) for _, reqs in self.inflight for req in reqs}
        rest = [req for req in self.running if id(req) not in flying]
        if rest and len(self.inflight) < lanes and self._lanes_fit(rest):
            share = -(-len(rest) // (lanes - len(self.inflight)))
            batch, reqs = self._decode(rest[:share])
            if batch is not None:
                launched = self.runner.launch(batch)
                if launched.results is None:
                    self.inflight.append((launched, reqs))
                    if len(self.inflight) < lanes:
                        return  # the pipeline is still filling
                else:  # run at once: its requests are no other lane's, so order is free
                    self._postprocess(batch, reqs, launched.results)
        launched, reqs = self.inflight.popleft()
        self._postprocess(launched.batch, reqs, self.runner.finish(launched))

    def _lanes_fit(self, reqs: list[Req]) -> bool:
        """Whether a decode of `reqs` may fly as a lane: no speculation (its drafts come from
        each step's tokens) and no hidden states reported."""
        return self.spec is None and not any(req.return_hidden_states for req in reqs)

    def drain(self) -> None:
        """Waits for the steps in flight, if any, and applies their tokens, oldest first."""
        while self.inflight:
            launched, reqs = self.inflight.popleft()
            self._postprocess(launched.batch, reqs, self.runner.finish(launched))

    def _notify_scheduled(self, batch: ScheduleBatch) -> None:
        hooks.notify(
            hooks.batch_scheduled,
            hooks.BatchInfo(
                not batch.is_decode, tuple(i.rid for i in batch.items), batch.num_tokens
            ),
        )

    def _schedule(self) -> tuple[ScheduleBatch | None, list[Req]]:
        """Prefill first (the unfinished chunk, then new requests while memory and the token
        budget allow); otherwise one decode step of every running request (with pipeline
        stages, of the first lane's share of them). Returns the batch and its requests,
        item for item."""
        if self.is_paused:
            return None, []
        loras = {req.lora_uid for req in self.running} if self.runner.lora else None
        extend = self.admission.take(self.chunked, len(self.running), loras)
        if not extend and self.waiting:
            self._stuck_at = self._queue_changes  # memory or --max-running-requests
        if extend:
            last, n = extend[-1]
            if last.num_computed + n < len(last.fill_ids):
                self.chunked = last  # the rest of its prompt comes in the next rounds
            new_pages: list[int] = []
            items = [extend_item(self.kv, req, n, new_pages) for req, n in extend]
            return self._prepared(ScheduleBatch(False, items, new_pages), [r for r, _ in extend])
        if not self.running:
            return None, []
        reqs = list(self.running)
        lanes = self.runner.decode_lanes
        if lanes > 1 and self._lanes_fit(reqs):  # the first lane; the others follow it
            # Those that decoded longest ago: when the lanes are taken back before the others
            # fly (a prompt waits for memory), every request still gets its turn.
            reqs = sorted(reqs, key=lambda req: req.decode_turn)[: -(-len(reqs) // lanes)]
        return self._decode(reqs)

    def _decode(self, reqs: list[Req]) -> tuple[ScheduleBatch | None, list[Req]]:
        """A decode step of `reqs` (each with its draft, when speculating)."""
        new_pages: list[int] = []
        for req in reqs:  # one turn each, in order: a cut by turn is a rotation
            self._decode_turns += 1
            req.decode_turn = self._decode_turns
        drafts = (
            self.spec.drafts(reqs, self.stops.suppressed_ids)
            if self.spec is not None
            else [[]] * len(reqs)
        )
        items = [decode_item(self.kv, req, new_pages, draft) for req, draft in zip(reqs, drafts)]
        return self._prepared(ScheduleBatch(True, items, new_pages), reqs)

    def _prepared(
        self, batch: ScheduleBatch, reqs: list[Req]
    ) -> tuple[ScheduleBatch | None, list[Req]]:
        """The batch with each item's sampling inputs; a request whose inputs fail ends, and
        leaves the batch before it runs. None when no item is left."""
        for req, error in prepare_sampling(batch, reqs, self.stops.suppressed_ids):
            self.fail(req, error, "preparing its sampling")
        if not batch.items:
            return None, []
        self._notify_scheduled(batch)
        return batch, reqs

    # ---- after the forward pass ---------------------------------------------------------------

    def _postprocess(
        self, batch: ScheduleBatch, reqs: list[Req], results: list[ItemResult]
    ) -> None:
        for item, req, result in zip(batch.items, reqs, results):
            if req.is_finished:  # ended (an abort, a stop) while its step was in flight
                continue
            try:
                self._apply(batch, item, req, result)
            except Exception as e:
                self.fail(req, e, "checking its stop conditions")
        self.profiler.on_step()
        if batch.is_decode:
            self._num_decode_steps += 1
            interval = self.args.decode_log_interval
            if interval and self._num_decode_steps % interval == 0:
                self._log_decode()

    def _log_decode(self) -> None:
        """--decode-log-interval's line (SGLang's "Decode batch" log)."""
        usage = self.kv.usage()
        used = usage.num_used_tokens
        logger.info(
            "Decode batch: #running-req %d, #token %d, token usage %.2f, "
            "gen throughput (token/s) %.2f, #queue-req %d",
            len(self.running), used, used / usage.num_tokens if usage.num_tokens else 0.0,
            self.throughput(), len(self.waiting),
        )  # fmt: skip

    def _apply(self, batch: ScheduleBatch, item: BatchItem, req: Req, result: ItemResult) -> None:
        if result.error is not None:
            return self.fail(req, result.error, result.error_stage)
        if item.logprob_rows:
            req.record_input_logprobs(result.input_logprobs, result.input_top, result.input_given)
        if result.hidden_states:
            req.record_hidden_states(item.start, result.hidden_states)
        # A verify step computed the K/V of its drafts too, but only the accepted ones count.
        req.num_computed = item.start + len(item.token_ids) - item.num_draft + len(result.more)
        if self.spec is not None and batch.is_decode:
            if item.num_draft:
                self.spec.verified(req, item.num_draft, result)
            elif result.next_id is not None:
                self.spec.sampled(req, result.next_id)
        if not batch.is_decode:
            self._cache_progress(req)
            if isinstance(self.pd, PrefillHandoff) and req.bootstrap is not None:
                self.pd.progress(req)  # its whole pages leave for the decode server now
            if req.num_computed < len(req.fill_ids):
                return  # more chunks to come
            if self.chunked is req:
                self.chunked = None
            if req.params.max_new_tokens == 0:
                return self._end(req, {"type": "length", "length": 0})
            if isinstance(self.pd, PrefillHandoff) and req.bootstrap is not None:
                return self._hand_over(self.pd, req, result)
            self.running.append(req)
        if result.next_id is not None:
            self._take_token(req, result)
        for more in result.more:  # accepted drafts: the tokens after them, while it runs
            if req.is_finished:
                break
            self._take_token(req, more)

    def _hand_over(self, pd: PrefillHandoff, req: Req, result: ItemResult) -> None:
        """A prefill server's request sampled its first token: that token and the last pages
        go to the decode server; the request answers once they are there (`Sent`)."""
        if result.next_id is None:
            return self.fail(req, RuntimeError("no first token was sampled"), "handing over")
        self._throughput_window.append((time.monotonic(), 1))
        self.num_generated_tokens += 1
        req.append_token(
            result.next_id, result.logprob, result.top_logprobs, result.token_ids_logprobs
        )
        done = Done(
            room=pd.room_of(req),
            token=result.next_id,
            logprob=result.logprob,
            top=result.top_logprobs,
            given=result.token_ids_logprobs,
            cached_tokens=req.cached_tokens,
        )
        pd.hand_over(req, done)

    def _take_token(self, req: Req, result: ItemResult) -> None:
        """`req` sampled `result.next_id`: record it, then end the request or stream it."""
        next_id = result.next_id
        assert next_id is not None  # only sampled results come here
        self._throughput_window.append((time.monotonic(), 1))
        self.num_generated_tokens += 1
        req.append_token(next_id, result.logprob, result.top_logprobs, result.token_ids_logprobs)
        if req.grammar is not None and not req.grammar.accept(next_id):
            if req.grammar.allows_nothing():
                req.output_ids.pop()  # drawn from a row with nothing allowed: not an output
                return self._end(req, dead_end_reason(req))
            raise RuntimeError(f"its grammar refused the token {next_id} it sampled")
        reason = self.stops.check(req, next_id)
        if reason is None and req.grammar is not None and req.grammar.is_terminated():
            reason = {"type": "stop", "matched": next_id}  # the grammar is complete
        if reason is not None:
            self._end(req, reason)
        elif req.stream and (
            req.num_sent == 0 or len(req.output_ids) - req.num_sent >= self.args.stream_interval
        ):
            self.outputs.append(req.next_output())  # the first token at once, then every K

    # ---- KV pages --------------------------------------------------------------------------------

    def _cache_progress(self, req: Req) -> None:
        """What `req` has computed goes into the prefix cache (its lock moves along)."""
        self.kv.cache_progress(req.admitted_kv, req.fill_ids[: req.num_computed])

    def _release(self, req: Req) -> None:
        if req.kv is not None:
            self.kv.release(req.kv)
            req.kv = None

    # ---- endings ---------------------------------------------------------------------------------

    def _end(self, req: Req, reason: dict) -> None:
        """Finishes `req` wherever it is (waiting, prefilling, running) and emits its last output.
        What it computed stays in the prefix cache, unless it failed (its KV is suspect)."""
        req.finished_reason = reason
        self._queue_changes += 1  # its pages and its running slot may let a prompt in
        if self.pd is not None:
            self.pd.ended(req, reason)
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
            self._cache_progress(req)
        if ok and self.spec is not None and reason.get("type") != "abort":
            self.spec.finished(req)
        self.sessions.on_end(req, ok)  # pins what it leaves in the cache before it lets go
        self._release(req)
        if req.lora is not None:
            self.runner.lora.release(req.lora)
            req.lora = None
        self.outputs.append(req.next_output())

    # ---- state for /get_load, /v1/loads and tests --------------------------------------------

    def num_used_tokens(self) -> int:
        """KV tokens held by live requests and pinned sessions (evictable cache not counted)."""
        return self.kv.usage().num_used_tokens

    def cache_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served from the prefix cache, since start."""
        return self.admission.cache_hit_rate()

    def throughput(self) -> float:
        window = self._throughput_window
        if len(window) < 2 or time.monotonic() - window[-1][0] > 5:
            return 0.0
        span = window[-1][0] - window[0][0]
        return sum(n for _, n in list(window)[1:]) / span if span > 0 else 0.0
