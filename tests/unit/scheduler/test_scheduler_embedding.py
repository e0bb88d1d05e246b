"""Embedding requests in the scheduler core, with a scripted runner and no weights: batched
under the token budget, finished in the step that ran them, never behind decodes, no KV
page held afterwards (a decoder's pages are taken for its step only), aborts while
waiting, and a failing request that fails alone."""

from __future__ import annotations

import pytest
from test_scheduler import PAGE, ScriptedRunner, assert_pool_full, make, request, run_until_idle

from cadence import io_struct
from cadence.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    BatchTokenizedEmbeddingReqInput,
    ContinueGenerationReqInput,
    GetLoadReqInput,
    PauseGenerationReqInput,
    TokenizedEmbeddingReqInput,
)
from cadence.scheduler.embedding import MIN_STEP_TOKENS, STEP_TARGET_S, EmbedOutput
from cadence.scheduler.req import to_messages


class EmbeddingRunner(ScriptedRunner):
    """Embeds an input as [its length, its first id, its first token type]; records each
    embedding batch and the pages its items held. Inputs starting with 666 make the pass
    raise (a request at fault)."""

    def __init__(self, needs_kv: bool = False):
        super().__init__()
        self.embed_needs_kv = needs_kv
        self.embed_batches: list[list[str]] = []
        self.pages_seen: list[list[int]] = []

    def embed(self, items):
        self.embed_batches.append([item.rid for item in items])
        self.pages_seen.append([p for item in items for p in item.pages])
        if any(item.token_ids[0] == 666 for item in items):
            raise RuntimeError("a bad input")
        return [
            [
                float(len(item.token_ids)),
                float(item.token_ids[0]),
                float((item.token_type_ids or [0])[0]),
            ]
            for item in items
        ]


def embed_request(rid, length=4, first=7, types=None, front=None) -> TokenizedEmbeddingReqInput:
    return TokenizedEmbeddingReqInput(
        rid=rid,
        input_text=None,
        input_ids=[first] + [5] * (length - 1),
        token_type_ids=types,
        http_worker_ipc=front,
    )


def embeds_of(outputs) -> dict[str, EmbedOutput]:
    return {o.rid: o for o in outputs if isinstance(o, EmbedOutput)}


def test_embedding_requests_are_batched_under_the_token_budget_and_end_in_one_step():
    s, runner, alloc = make(runner=EmbeddingRunner(), chunk=10)
    for rid in ("a", "b", "c"):
        s.handle(embed_request(rid, length=4))
    out = embeds_of(s.step())
    assert runner.embed_batches == [["a", "b"]]  # 8 tokens fit the budget of 10, 12 do not
    assert set(out) == {"a", "b"}
    assert out["a"].embedding == [4.0, 7.0, 0.0]
    assert out["a"].finished_reason == {"type": "length", "length": 0}
    assert out["a"].prompt_tokens == 4
    out = embeds_of(s.step())
    assert set(out) == {"c"} and not s.has_work
    assert runner.batches == []  # no generation step ran
    assert_pool_full(s, alloc)


def test_a_request_s_items_arrive_in_one_message_and_queue_together():
    s, runner, alloc = make(runner=EmbeddingRunner(), chunk=64)
    items = [embed_request(rid, length=3, front="ipc://f0") for rid in ("x0", "x1", "x2")]
    msg = io_struct.decode(io_struct.encode(BatchTokenizedEmbeddingReqInput(batch=items)))
    assert s.handle(msg) is None
    assert s.handle(GetLoadReqInput()).num_waiting_reqs == 3
    out = embeds_of(s.step())
    assert runner.embed_batches == [["x0", "x1", "x2"]]  # one forward pass
    assert [out[rid].http_worker_ipc for rid in ("x0", "x1", "x2")] == ["ipc://f0"] * 3
    assert_pool_full(s, alloc)


def test_an_input_longer_than_the_budget_still_runs_alone():
    s, runner, _ = make(runner=EmbeddingRunner(), chunk=4)
    s.handle(embed_request("long", length=9))
    s.handle(embed_request("short", length=2))
    assert set(embeds_of(s.step())) == {"long"}
    assert set(embeds_of(s.step())) == {"short"}


def test_embeddings_never_wait_behind_decodes():
    s, runner, alloc = make(runner=EmbeddingRunner(), chunk=64, num_pages=16)
    s.handle(request("gen", prompt_len=4, max_new=50))
    s.step()  # prefill: "gen" decodes from now on, for many steps
    assert s.running
    s.handle(embed_request("e"))
    out = embeds_of(s.step())
    assert set(out) == {"e"}  # the very next step, while "gen" keeps decoding
    assert s.running and runner.batches[-1].is_decode
    s.handle(AbortReq(rid="gen"))
    s.step()
    assert_pool_full(s, alloc)


def test_a_decoder_takes_kv_pages_for_its_step_only_and_caches_nothing():
    s, runner, alloc = make(runner=EmbeddingRunner(needs_kv=True), num_pages=8, chunk=64)
    s.handle(embed_request("a", length=6))  # 2 pages of 4
    s.handle(embed_request("b", length=3))  # 1 page
    out = embeds_of(s.step())
    assert set(out) == {"a", "b"}
    assert len(runner.pages_seen[0]) == 3 and len(set(runner.pages_seen[0])) == 3
    assert alloc.num_free_pages == alloc.num_pages  # given back at once
    assert s.kv.usage().num_cached == 0  # nothing went into the prefix cache
    assert_pool_full(s, alloc)


def test_a_decoder_request_waits_for_pages_and_runs_once_they_are_free():
    s, runner, alloc = make(runner=EmbeddingRunner(needs_kv=True), num_pages=4, chunk=64)
    s.handle(embed_request("a", length=4 * PAGE))  # the whole pool
    s.handle(embed_request("b", length=PAGE))
    assert set(embeds_of(s.step())) == {"a"}  # "b" found no page this step
    assert set(embeds_of(s.step())) == {"b"}
    assert alloc.num_free_pages == alloc.num_pages


def test_a_request_that_fails_the_forward_pass_fails_alone():
    s, runner, alloc = make(runner=EmbeddingRunner(), chunk=64)
    s.handle(embed_request("good"))
    s.handle(embed_request("bad", first=666))
    s.handle(embed_request("also-good", first=9))
    out = embeds_of(s.step())
    assert out["good"].embedding == [4.0, 7.0, 0.0] and out["also-good"].embedding[1] == 9.0
    reason = out["bad"].finished_reason
    assert out["bad"].embedding is None
    assert reason["status_code"] == 500 and reason["request_fault"]
    assert "a bad input" in reason["message"]
    assert runner.embed_batches[0] == ["good", "bad", "also-good"]  # then one by one
    assert s.embeds.num_failed_requests == 1
    assert_pool_full(s, alloc)


def test_aborts_and_pauses_end_waiting_embeddings():
    s, runner, _ = make(runner=EmbeddingRunner(), chunk=64)
    s.handle(PauseGenerationReqInput(mode="in_place"))
    for rid in ("a", "b", "c"):
        s.handle(embed_request(rid))
    assert s.step() == [] and runner.embed_batches == []  # paused: nothing runs
    assert s.handle(GetLoadReqInput()).num_waiting_reqs == 3
    s.handle(AbortReq(rid="b", message="client went away"))
    s.handle(ContinueGenerationReqInput())
    out = embeds_of(s.step())
    assert out["b"].embedding is None
    assert out["b"].finished_reason == {"type": "abort", "message": "client went away"}
    assert out["a"].embedding and out["c"].embedding
    assert runner.embed_batches == [["a", "c"]]
    s.handle(embed_request("d"))
    s.handle(PauseGenerationReqInput(mode="abort"))
    assert embeds_of(s.outputs)["d"].finished_reason["type"] == "abort"
    assert s.embeds.num_waiting == 0


def test_the_token_types_reach_the_runner():
    s, runner, _ = make(runner=EmbeddingRunner(), chunk=64)
    s.handle(embed_request("pair", length=3, types=[1, 1, 1]))
    assert embeds_of(s.step())["pair"].embedding == [3.0, 7.0, 1.0]


def test_outputs_leave_as_one_message_per_front_beside_the_token_outputs():
    s, runner, _ = make(runner=EmbeddingRunner(), chunk=64)
    s.handle(embed_request("a", front="ipc://f0"))
    s.handle(embed_request("b", front="ipc://f1"))
    s.handle(embed_request("c", front="ipc://f0"))
    s.handle(request("gen", prompt_len=4, max_new=1))
    messages = to_messages(s.step(), s.weight_version)
    tokens = [m for m in messages if isinstance(m, BatchTokenIDOutput)]
    embeds = {m.http_worker_ipcs[0]: m for m in messages if isinstance(m, BatchEmbeddingOutput)}
    assert [t.rids for t in tokens] == [["gen"]]
    assert embeds["ipc://f0"].rids == ["a", "c"] and embeds["ipc://f1"].rids == ["b"]
    assert set(embeds["ipc://f0"].http_worker_ipcs) == {"ipc://f0"}
    assert embeds["ipc://f1"].embeddings == [[4.0, 7.0, 0.0]]


# ---- large requests are split into steps, taken fairly ---------------------------------------


def batch_request(prefix, count, length=4, front=None) -> BatchTokenizedEmbeddingReqInput:
    """One request of `count` inputs (rids prefix0, prefix1, ...), as the front sends it."""
    return BatchTokenizedEmbeddingReqInput(
        batch=[embed_request(f"{prefix}{i}", length=length, front=front) for i in range(count)]
    )


class Clock:
    """A clock the runner moves: each embedding step takes `seconds_per_token` per token."""

    def __init__(self, runner: EmbeddingRunner, seconds_per_token: float):
        self.now = 0.0
        self.seconds_per_token = seconds_per_token
        real = runner.embed

        def embed(items):
            self.now += self.seconds_per_token * sum(len(item.token_ids) for item in items)
            return real(items)

        runner.embed = embed

    def __call__(self) -> float:
        return self.now


def test_a_one_input_request_runs_in_the_next_step_behind_a_large_one():
    s, runner, alloc = make(runner=EmbeddingRunner(), chunk=16)
    s.handle(batch_request("big", 8, length=8))  # 64 tokens: four steps of 16
    assert set(embeds_of(s.step())) == {"big0", "big1"}
    s.handle(embed_request("small", length=4))
    out = embeds_of(s.step())
    assert runner.embed_batches[1] == ["small", "big2"]  # first: it has had nothing computed
    assert set(out) == {"small", "big2"}
    outputs = run_until_idle(s)
    assert set(embeds_of(outputs)) == {f"big{i}" for i in range(3, 8)}
    assert [len(b) for b in runner.embed_batches] == [2, 2, 2, 2, 1]
    assert s.embeds.num_waiting == 0 and not s.embeds.groups
    assert_pool_full(s, alloc)


def test_waiting_requests_take_turns_the_least_computed_first():
    s, runner, _ = make(runner=EmbeddingRunner(), chunk=8)
    s.handle(batch_request("a", 4))
    s.handle(batch_request("b", 4))
    s.step()
    s.handle(batch_request("c", 2))  # nothing computed yet: it goes first
    run_until_idle(s)
    # One input per request in turn, the request with the fewest tokens computed first (the
    # older one on a tie), while the step's budget of 8 tokens allows.
    assert runner.embed_batches == [
        ["a0", "b0"],
        ["c0", "a1"],
        ["b1", "c1"],
        ["a2", "b2"],
        ["a3", "b3"],
    ]


def test_a_request_alone_fills_each_step_with_its_inputs():
    s, runner, _ = make(runner=EmbeddingRunner(), chunk=12)
    s.handle(batch_request("x", 7, length=4))
    run_until_idle(s)
    assert runner.embed_batches == [["x0", "x1", "x2"], ["x3", "x4", "x5"], ["x6"]]


def test_a_shorter_input_of_another_request_fills_what_a_long_one_leaves():
    s, runner, _ = make(runner=EmbeddingRunner(), chunk=10)
    s.handle(batch_request("long", 2, length=6))
    s.handle(batch_request("short", 2, length=2))
    s.step()
    assert runner.embed_batches == [["long0", "short0", "short1"]]  # long1 does not fit


def test_the_step_budget_follows_the_measured_speed_above_one_context():
    s, runner, _ = make(runner=EmbeddingRunner(), chunk=8000)
    queue = s.embeds
    queue.clock = Clock(runner, seconds_per_token=1e-5)  # 100,000 tokens a second (a GPU)
    assert queue.step_budget() == MIN_STEP_TOKENS  # nothing measured yet
    s.handle(batch_request("x", 200, length=10))
    s.step()
    assert len(runner.embed_batches[0]) == 51  # 510 tokens
    assert queue.tokens_per_s == pytest.approx(100_000)
    assert queue.step_budget() == 8000  # STEP_TARGET_S would take more: the prefill budget caps it
    s.step()
    assert len(runner.embed_batches[1]) == 149  # the rest, in one step
    queue.clock.seconds_per_token = 1e-4  # ten times slower
    s.handle(batch_request("y", 10_000, length=10))
    s.step()
    assert queue.tokens_per_s == pytest.approx(55_000)  # half the newest step, half before
    for _ in range(16):
        s.step()
    assert queue.step_budget() == pytest.approx(10_000 * STEP_TARGET_S, rel=0.01)
    queue.clock.seconds_per_token = 1.0  # a busy CPU: steps never shrink below one context
    for _ in range(10):
        s.step()
    assert queue.step_budget() == MIN_STEP_TOKENS
    assert len(runner.embed_batches[-1]) == 51


def test_an_abort_ends_a_partly_run_request_s_waiting_inputs_and_frees_everything():
    s, runner, alloc = make(runner=EmbeddingRunner(needs_kv=True), num_pages=8, chunk=8)
    s.handle(batch_request("big", 6, length=4))
    s.handle(embed_request("other", length=4))
    out = embeds_of(s.step())
    assert set(out) == {"big0", "other"}
    assert alloc.num_free_pages == alloc.num_pages  # pages are held within a step only
    for i in range(1, 6):  # the client went away: the front aborts every unfinished input
        s.handle(AbortReq(rid=f"big{i}", message="the client went away"))
    out = embeds_of(s.step())
    assert set(out) == {f"big{i}" for i in range(1, 6)}
    assert all(o.embedding is None and o.finished_reason["type"] == "abort" for o in out.values())
    assert s.embeds.num_waiting == 0 and not s.embeds.groups and not s.has_work
    assert s.handle(GetLoadReqInput()).num_waiting_reqs == 0
    assert len(runner.embed_batches) == 1  # nothing more ran
    assert_pool_full(s, alloc)


def test_abort_all_ends_every_request_whatever_ran_of_it():
    s, runner, alloc = make(runner=EmbeddingRunner(), chunk=8)
    s.handle(batch_request("a", 5))
    s.handle(batch_request("b", 3))
    s.step()
    s.handle(AbortReq(abort_all=True, message="shutting down"))
    assert set(embeds_of(s.outputs)) == {"a1", "a2", "a3", "a4", "b1", "b2"}
    assert s.embeds.num_waiting == 0 and not s.embeds.groups
    assert_pool_full(s, alloc)
