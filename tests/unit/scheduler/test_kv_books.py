"""The KV books under random scheduler runs, with a scripted runner and no weights.

A Hypothesis state machine drives one scheduler the way a busy server would: generation
requests with shared prefixes (streaming, prompt logprobs, hidden states, failing ones),
embedding inputs of a decoder (they take KV pages for their step) on the same pool, session
turns that pin their KV, aborts, retraction, pauses and flushes, in a pool small enough that
requests wait, evict and unpin. After every rule (every step included) it checks that
free + evictable + in use == the pool with in-use pages recounted from their holders
(`KVManager.check`), that every admitted request's reservation is covered (the pages it may
still grow into are free and promised to nobody else), and that waiting requests hold
nothing; inside every forward pass too (an embedding step holds its pages only there). At
the end everything is aborted and the pool must be whole again.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_scheduler import PAGE, assert_pool_full, make, request, run_until_idle
from test_scheduler_embedding import EmbeddingRunner, embed_request, embeds_of

from cadence.io_struct import (
    AbortReq,
    CloseSessionReqInput,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    OpenSessionReqInput,
    PauseGenerationReqInput,
    SessionParams,
)

# Prompts over a tiny alphabet share prefixes often (whole pages of 4 tokens).
prompts = st.lists(st.integers(3, 5), min_size=1, max_size=14)


class CheckingRunner(EmbeddingRunner):
    """Checks the pool from inside each forward pass: after the batch grew into its
    reservations, and while an embedding step holds its pages. What it finds is kept for
    the machine's invariant (the scheduler would take an error raised here for the
    request's own)."""

    def __init__(self):
        super().__init__(needs_kv=True)  # generates, and embeds with KV pages
        self.kv = None  # the scheduler's KV manager, once it exists
        self.problems: list[str] = []

    def check_pool(self) -> None:
        try:
            usage = self.kv.check()
        except RuntimeError as e:
            self.problems.append(str(e))
            return
        if usage.num_promised > usage.num_free:
            self.problems.append(f"pages promised to requests were taken: {usage}")

    def run(self, batch):
        self.check_pool()
        return super().run(batch)

    def embed(self, items):
        self.check_pool()
        return super().embed(items)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.runner = CheckingRunner()
        self.s, _, self.alloc = make(num_pages=8, chunk=8, max_running=3, runner=self.runner)
        self.runner.kv = self.s.kv
        self.num_rids = 0
        self.session_ids: list[str] = []

    def _rid(self) -> str:
        self.num_rids += 1
        return f"r{self.num_rids}"

    # ---- traffic ---------------------------------------------------------------------------

    @rule(
        prompt=prompts,
        max_new=st.integers(0, 10),
        stream=st.booleans(),
        extra=st.sampled_from(["", "", "", "logprobs", "hidden", "fails"]),
    )
    def generate(self, prompt, max_new, stream, extra):
        msg = request(self._rid(), max_new=max_new)
        msg.input_ids, msg.stream = prompt, stream
        if extra == "logprobs":
            msg.return_logprob, msg.logprob_start_len = True, len(prompt) // 2
        elif extra == "hidden":
            msg.return_hidden_states = True
        elif extra == "fails":
            self.runner.fail_rids.add(msg.rid)
        self.s.handle(msg)

    @rule(length=st.integers(1, 12))
    def embed(self, length):
        self.s.handle(embed_request(self._rid(), length=length))

    @precondition(lambda self: len(self.session_ids) < 3)
    @rule()
    def open_session(self):
        reply = self.s.handle(OpenSessionReqInput(streaming=True))
        assert reply.success
        self.session_ids.append(reply.session_id)

    @precondition(lambda self: self.session_ids)
    @rule(data=st.data(), prompt=prompts, max_new=st.integers(1, 6))
    def session_turn(self, data, prompt, max_new):
        sid = data.draw(st.sampled_from(self.session_ids))
        msg = request(self._rid(), max_new=max_new)
        msg.input_ids, msg.session_params = prompt, SessionParams(id=sid)
        self.s.handle(msg)

    @precondition(lambda self: self.session_ids)
    @rule(data=st.data())
    def close_session(self, data):
        sid = data.draw(st.sampled_from(self.session_ids))
        self.session_ids.remove(sid)
        assert self.s.handle(CloseSessionReqInput(session_id=sid)).success

    # ---- control ---------------------------------------------------------------------------

    @rule(num=st.integers(1, 4))
    def step(self, num):
        for _ in range(num):
            self.s.step()
            self.books_balance()

    @precondition(lambda self: self.num_rids)
    @rule(data=st.data())
    def abort_one(self, data):
        rid = f"r{data.draw(st.integers(1, self.num_rids))}"
        self.s.handle(AbortReq(rid=rid, message="client left"))

    @rule(mode=st.sampled_from(["retract", "in_place", "abort"]), steps=st.integers(0, 2))
    def pause_and_continue(self, mode, steps):
        self.s.handle(PauseGenerationReqInput(mode=mode))
        ran = len(self.runner.batches), len(self.runner.embed_batches)
        for _ in range(steps):
            self.s.step()
        assert (len(self.runner.batches), len(self.runner.embed_batches)) == ran  # paused
        self.books_balance()
        self.s.handle(ContinueGenerationReqInput())

    @rule()
    def flush(self):
        self.s.handle(FlushCacheReqInput())  # refused while anything runs

    # ---- the books -------------------------------------------------------------------------

    @invariant()
    def books_balance(self):
        s = self.s
        assert not self.runner.problems, self.runner.problems[0]
        usage = s.kv.check()  # free + evictable + in use == pool, recounted from the holders
        assert usage.num_pages == self.alloc.num_pages
        admitted = s.running + ([s.chunked] if s.chunked else [])
        for req in admitted:
            handle = req.kv
            assert handle is not None, f"{req.rid} runs without its reservation"
            assert handle.num_reserved >= s.kv.pages_for(req.total_tokens_needed(s.context_len))
            assert len(handle.pages) * PAGE >= req.num_computed
        # Every page an admitted request may still take is free, and promised to it alone.
        promised = sum(req.kv.num_promised for req in admitted if req.kv is not None)
        assert promised == usage.num_promised <= usage.num_free
        assert all(req.kv is None for req in s.waiting)
        assert s.num_used_tokens() == usage.num_in_use * PAGE

    def teardown(self):
        for sid in self.session_ids:
            self.s.handle(CloseSessionReqInput(session_id=sid))
        self.s.handle(ContinueGenerationReqInput())
        self.s.handle(AbortReq(abort_all=True))
        run_until_idle(self.s)
        assert_pool_full(self.s, self.alloc)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


def test_an_embedding_waits_for_pages_not_promised_to_a_running_request():
    s, runner, alloc = make(runner=EmbeddingRunner(needs_kv=True), num_pages=6, chunk=64)
    s.handle(request("gen", prompt_len=4, max_new=16))  # 20 tokens: 5 pages promised
    s.step()  # its prefill took 1 page: 5 free, 4 of them promised to it
    assert s.kv.usage().num_promised == 4
    s.handle(embed_request("emb", length=2 * PAGE))  # 2 pages: only 1 is not promised
    ran = set()
    while "gen" in {r.rid for r in s.running}:
        ran |= set(embeds_of(s.step()))
        usage = s.kv.check()
        assert usage.num_promised <= usage.num_free
    assert "emb" not in ran, "the embedding took pages promised to the running request"
    assert set(embeds_of(run_until_idle(s))) == {"emb"}  # then it runs
    assert_pool_full(s, alloc)
