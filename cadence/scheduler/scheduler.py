"""The engine loop: admit requests, run one prefill or decode step, sample, emit outputs.

Single-threaded by design: only the thread that calls `step()` touches requests, KV pages
or queues. Admission reserves every page a request can ever need (prompt plus
max_new_tokens), so a running request never runs out of KV memory mid-generation; a request
that does not fit yet waits, and one that can never fit is refused at once.

Failures are isolated per request: an exception while preparing, sampling, computing
logprobs or checking the stop conditions of one request fails that request alone (a 500
marked as caused by the request, its KV pages freed) and the batch goes on. Only the model
forward itself, which every request in the batch shares, may raise out of `step()`.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from cadence import hooks
from cadence.layers.sampler import SamplingInput, sample
from cadence.scheduler.model_runner import ModelRunner
from cadence.scheduler.req import Req, ReqOutput
from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, model_path: str, tokenizer):
        self.args = args
        self.runner = ModelRunner(args, model_path)
        self.tokenizer = tokenizer
        self.context_len = self.runner.context_len
        self.eos_ids = set(self.runner.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # prefill complete, decoding
        self.chunked: Req | None = None  # admitted, prefill in progress
        self.is_paused = False
        self.outputs: list[ReqOutput] = []
        self.num_generated_tokens = 0
        self.num_failed_requests = 0  # requests ended by an error of their own (see `fail`)
        self.gen_throughput = 0.0
        self._throughput_window: deque[tuple[float, int]] = deque(maxlen=64)
        if args.random_seed is not None:
            self.runner.platform.seed(args.random_seed)

    # ---- requests in -----------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        try:
            if req.params.seed is not None:
                req.generator = self.runner.platform.make_generator(req.params.seed)
        except Exception as e:
            return self.fail(req, e, "seeding its random generator")
        if len(req.input_ids) + req.params.max_new_tokens > self.context_len and req.params.max_new_tokens:
            return self._refuse(req, f"the prompt ({len(req.input_ids)} tokens) plus max_new_tokens "
                                     f"({req.params.max_new_tokens}) exceeds the context length ({self.context_len})")
        need = self.runner.pages_for(req.total_tokens_needed(self.context_len))
        if need > self.runner.allocator.num_pages:
            return self._refuse(req, f"the request needs {need * self.runner.page_size} KV tokens but the "
                                     f"whole pool holds {self.runner.max_total_tokens}; lower max_new_tokens")
        self.waiting.append(req)

    def _refuse(self, req: Req, message: str) -> None:
        req.finished_reason = {"type": "abort", "message": message, "status_code": 400}
        self.outputs.append(self._output(req))

    def fail(self, req: Req, error: BaseException, stage: str) -> None:
        """Ends `req` with an internal error caused by the request itself (a 500 that a router
        must not retry elsewhere), frees what it holds, and leaves every other request alone."""
        logger.error("request %s failed while %s; it ends with an error, the batch goes on", req.rid, stage,
                     exc_info=error)
        self.num_failed_requests += 1
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None
        self._finish(req, {"type": "abort", "status_code": 500, "request_fault": True,
                           "message": f"internal error while {stage}: {type(error).__name__}: {error}"})

    def fail_rid(self, rid: str, error: BaseException, stage: str) -> None:
        """`fail` for the live request `rid`, if there is one."""
        for req in [*self.waiting, *([self.chunked] if self.chunked else []), *self.running]:
            if req.rid == rid:
                return self.fail(req, error, stage)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> None:
        """Ends the request(s) now, releasing their KV pages; unknown rids are ignored."""
        def hit(r: Req) -> bool:
            return abort_all or r.rid == rid

        for req in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "message": message})
        if self.chunked is not None and hit(self.chunked):
            req, self.chunked = self.chunked, None
            self._finish(req, {"type": "abort", "message": message})
        for req in [r for r in self.running if hit(r)]:
            self._finish(req, {"type": "abort", "message": message})

    def retract_all(self) -> None:
        """Moves every admitted request back to the front of the queue, freeing its KV."""
        admitted = ([self.chunked] if self.chunked else []) + self.running
        self.chunked, self.running = None, []
        for req in reversed(admitted):
            self._release(req)
            req.num_computed = 0
            self.waiting.appendleft(req)

    # ---- the loop body ---------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return not self.is_paused and bool(self.waiting or self.running or self.chunked)

    def step(self) -> list[ReqOutput]:
        """One scheduling round. Returns the outputs produced since the last call."""
        if not self.is_paused:
            batch = self._schedule_extend()
            if batch:
                self._announce(True, batch[0], sum(batch[1]))
                self._run_extend(*batch)
            elif self.running:
                self._announce(False, self.running, len(self.running))
                self._run_decode()
        if not self.running:
            self.runner.release_decode_state()
        outputs, self.outputs = self.outputs, []
        return outputs

    @staticmethod
    def _announce(is_prefill: bool, reqs: list[Req], num_tokens: int) -> None:
        """The `batch_scheduled` hook point, for plugins."""
        hooks.notify(hooks.batch_scheduled, hooks.BatchInfo(is_prefill, tuple(r.rid for r in reqs), num_tokens))

    def _outstanding_pages(self) -> int:
        admitted = self.running + ([self.chunked] if self.chunked else [])
        return sum(r.num_reserved_pages - len(r.pages) for r in admitted)

    def _schedule_extend(self):
        budget = self.args.chunked_prefill_size
        reqs, lens = [], []
        if self.chunked is not None:
            req = self.chunked
            n = min(len(req.fill_ids) - req.num_computed, budget)
            reqs.append(req), lens.append(n)
            budget -= n
        available = self.runner.allocator.num_free_pages - self._outstanding_pages()
        while self.waiting and budget > 0 and len(self.running) + len(reqs) < self.args.max_running_requests:
            req = self.waiting[0]
            need = self.runner.pages_for(req.total_tokens_needed(self.context_len))
            if need > available or self.runner.req_to_token.num_free_rows == 0:
                break  # waits for memory; FIFO, so nothing behind it jumps the queue
            self.waiting.popleft()
            req.row = self.runner.req_to_token.alloc()
            req.num_reserved_pages = need
            available -= need
            n = min(len(req.fill_ids) - req.num_computed, budget)
            reqs.append(req), lens.append(n)
            budget -= n
            if req.num_computed + n < len(req.fill_ids):
                self.chunked = req
        return (reqs, lens) if reqs else None

    def _input_logprob_rows(self, req: Req, start: int, n: int) -> list[int]:
        """Offsets in this chunk whose logits give the logprob of the following prompt token."""
        if not req.wants_input_logprobs:
            return []
        first = max(req.logprob_start_len, 1) - 1
        last = len(req.input_ids) - 2
        return [p - start for p in range(max(start, first), min(start + n - 1, last) + 1)]

    def _run_extend(self, reqs: list[Req], lens: list[int]) -> None:
        logit_rows, completes = [], []
        for req, n in zip(reqs, lens):
            rows = self._input_logprob_rows(req, req.num_computed, n)
            done = req.num_computed + n == len(req.fill_ids)
            if done:
                rows.append(n - 1)
            logit_rows.append(rows), completes.append(done)
        logits = self.runner.forward_extend(reqs, lens, logit_rows)
        offset = 0
        to_sample, sample_rows = [], []
        for req, n, rows, done in zip(reqs, lens, logit_rows, completes):
            num_lp = len(rows) - (1 if done else 0)
            first = offset
            req.num_computed += n
            offset += len(rows)
            if num_lp:
                try:
                    self._record_input_logprobs(req, logits[first : first + num_lp],
                                                req.num_computed - n + rows[0])
                except Exception as e:
                    self.fail(req, e, "computing its prompt logprobs")
                    continue
            if not done:
                continue
            if self.chunked is req:
                self.chunked = None
            if req.params.max_new_tokens == 0 or req.is_finished:
                self._finish(req, req.finished_reason or {"type": "length", "length": 0})
                continue
            self.running.append(req)
            to_sample.append(req)
            sample_rows.append(offset - 1)
        if to_sample:
            self._sample_and_advance(to_sample, logits[sample_rows])

    def _run_decode(self) -> None:
        reqs = list(self.running)
        logits = self.runner.forward_decode(reqs)
        for req in reqs:
            req.num_computed = req.seq_len
        self._sample_and_advance(reqs, logits)

    # ---- sampling and stop conditions ------------------------------------------------

    def _sampling_input(self, req: Req) -> SamplingInput:
        p = req.params
        suppress = None
        if len(req.output_ids) < p.min_new_tokens:
            suppress = list((set() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids or ()))
        return SamplingInput(p, req.input_ids, req.output_ids, req.generator, suppress,
                             req.top_logprobs_num, req.token_ids_logprob, req.return_logprob)

    def _sample_and_advance(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Samples one token for each of `reqs` (row i of `logits` is request i's) and applies
        it: logprobs, stop conditions, streamed output. A request that fails here ends alone."""
        rows, keep = [], []
        for i, req in enumerate(reqs):
            try:
                rows.append(self._sampling_input(req))
                keep.append(i)
            except Exception as e:
                self.fail(req, e, "preparing its sampling")
        if len(keep) < len(reqs):
            reqs, logits = [reqs[i] for i in keep], logits[keep]
        sampled = self._sample(reqs, logits, rows)
        self._throughput_window.append((time.monotonic(), len(sampled)))
        self.num_generated_tokens += len(sampled)
        for req, token, logprob, top, given in sampled:
            try:
                self._advance(req, token, logprob, top, given)
            except Exception as e:
                self.fail(req, e, "checking its stop conditions")

    def _sample(self, reqs: list[Req], logits: torch.Tensor, rows: list[SamplingInput]) -> list[tuple]:
        """(req, token, logprob, top logprobs, given-id logprobs) per request. When the batch
        fails, each row is sampled alone, so only the rows that fail by themselves fail."""
        try:
            outs = [(sample(logits, rows), range(len(reqs)))]
        except Exception:
            outs = []
            for i, row in enumerate(rows):
                try:
                    outs.append((sample(logits[i : i + 1], [row]), [i]))
                except Exception as e:
                    self.fail(reqs[i], e, "sampling its next token")
        sampled = []
        for out, indices in outs:
            for j, i in enumerate(indices):
                sampled.append((reqs[i], out.next_ids[j], out.logprobs and out.logprobs[j],
                                out.top_logprobs and out.top_logprobs[j],
                                out.token_ids_logprobs and out.token_ids_logprobs[j]))
        return sampled

    def _advance(self, req: Req, token: int, logprob, top, given) -> None:
        req.output_ids.append(token)
        if req.return_logprob:
            req.pending_logprobs.append((logprob, token))
            req.pending_top.append(top)
            req.pending_given.append(given)
        reason = self._check_finished(req, token)
        if reason is not None:
            self._finish(req, reason)
        elif req.stream:
            self.outputs.append(self._output(req))

    def _check_finished(self, req: Req, token: int) -> dict | None:
        p = req.params
        num_out = len(req.output_ids)
        if num_out >= p.min_new_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                return {"type": "stop", "matched": token}
            if p.stop_token_ids and token in p.stop_token_ids:
                return {"type": "stop", "matched": token}
            if p.stop:
                matched = self._match_stop_string(req)
                if matched is not None:
                    return {"type": "stop", "matched": matched}
        if num_out >= p.max_new_tokens:
            return {"type": "length", "length": num_out}
        if req.seq_len >= self.context_len:
            return {"type": "length", "length": num_out}
        return None

    def _match_stop_string(self, req: Req) -> str | None:
        # A byte-level token decodes to at least one byte, so this many tokens cover any stop
        # string, even one of multi-byte characters.
        longest = max(len(s.encode("utf-8")) for s in req.params.stop)
        window = req.output_ids[-(longest + 1):]
        tail = self.tokenizer.decode(window, skip_special_tokens=False)
        before = self.tokenizer.decode(window[:-1], skip_special_tokens=False).rstrip("\ufffd")
        for stop in req.params.stop:
            # Only an occurrence reaching into the newest token counts: an earlier one was
            # ignored under min_new_tokens and must not end the request now.
            if tail.find(stop, max(len(before) - len(stop) + 1, 0)) != -1:
                return stop
        return None

    # ---- endings ---------------------------------------------------------------------

    def _release(self, req: Req) -> None:
        if req.pages:
            self.runner.allocator.decref(req.pages)
            req.pages = []
        if req.row >= 0:
            self.runner.req_to_token.free(req.row)
            req.row = -1
        req.num_reserved_pages = 0

    def _finish(self, req: Req, reason: dict) -> None:
        req.finished_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self.outputs.append(self._output(req))

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor, first_pos: int) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if req.input_logprobs is None:
            req.input_logprobs, req.input_top, req.input_given = [], [], []
            if req.logprob_start_len == 0:
                req.input_logprobs.append((None, req.input_ids[0]))
                req.input_top.append([])
                req.input_given.append([])
        targets = torch.tensor(req.input_ids[first_pos + 1 : first_pos + 1 + logprobs.shape[0]])
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        req.input_logprobs.extend(zip(chosen, targets.tolist()))
        for row in logprobs:
            top = row.topk(req.top_logprobs_num) if req.top_logprobs_num else None
            req.input_top.append(list(zip(top.values.tolist(), top.indices.tolist())) if top else [])
            ids = req.token_ids_logprob
            req.input_given.append(list(zip(row[ids].tolist(), ids)) if ids else [])

    def _output(self, req: Req) -> ReqOutput:
        new_ids = req.output_ids[req.num_sent:]
        req.num_sent = len(req.output_ids)
        out = ReqOutput(req.rid, new_ids, req.finished_reason, len(req.input_ids), len(req.output_ids),
                        req.cached_tokens, req.http_worker_ipc, req.params, req.return_logprob)
        if req.return_logprob:
            out.output_logprobs, req.pending_logprobs = req.pending_logprobs, []
            out.output_top_logprobs, req.pending_top = req.pending_top, []
            out.output_token_ids_logprobs, req.pending_given = req.pending_given, []
            if not req.input_logprobs_sent and (req.input_logprobs is not None or req.is_finished or new_ids):
                out.input_logprobs = req.input_logprobs or []
                out.input_top_logprobs = req.input_top or []
                out.input_token_ids_logprobs = req.input_given or []
                req.input_logprobs_sent = True
        return out

    # ---- state for /get_load, /v1/loads and tests -----------------------------------------

    def num_used_tokens(self) -> int:
        alloc = self.runner.allocator
        return (alloc.num_pages - alloc.num_free_pages) * self.runner.page_size

    def throughput(self) -> float:
        window = self._throughput_window
        if len(window) < 2 or time.monotonic() - window[-1][0] > 5:
            return 0.0
        span = window[-1][0] - window[0][0]
        return sum(n for _, n in list(window)[1:]) / span if span > 0 else 0.0
