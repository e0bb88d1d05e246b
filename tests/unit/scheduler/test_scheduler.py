"""The scheduler core with a scripted runner and no weights: admission and waiting for KV
memory, chunked prefill, decode, finishing by length and by stop id, aborts while waiting,
prefilling and decoding, per-request failures, every control message through `handle`, and
the KV pool back to full after each."""

from __future__ import annotations

import pytest

from cadence.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    GetWeightVersionReqInput,
    PauseGenerationReqInput,
    ProfileReq,
    ProfileReqOutput,
    SamplingParams,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightVersionReqInput,
)
from cadence.mem_cache.allocator import PageAllocator
from cadence.mem_cache.kv_manager import KVManager
from cadence.model_executor.runner import ItemResult, Runner, ScheduleBatch
from cadence.scheduler.req import to_messages
from cadence.scheduler.scheduler import Scheduler
from cadence.scheduler.stop_checker import StopChecker
from cadence.server_args import ServerArgs

EOS = 2
PAGE = 4


class ScriptedRunner(Runner):
    """Samples token 10 + position (so outputs are predictable); EOS once a request's
    sequence reaches `eos_at` tokens. Records every batch it runs."""

    def __init__(self, context_len: int = 64, eos_at: int | None = None):
        self.context_len = context_len
        self.eos_token_ids = (EOS,)
        self.eos_at = eos_at
        self.batches: list[ScheduleBatch] = []
        self.fail_rids: set[str] = set()  # rids whose sampling raises
        self.weights_error: Exception | None = NotImplementedError("no weights here")

    def run(self, batch: ScheduleBatch) -> list[ItemResult]:
        self.batches.append(batch)
        results = []
        for item in batch.items:
            result = ItemResult(
                input_logprobs=[(-1.0, t) for t in item.logprob_targets],
                input_top=[[] for _ in item.logprob_rows],
                input_given=[[] for _ in item.logprob_rows],
            )
            if item.sampling is not None:
                if item.rid in self.fail_rids:
                    result.error, result.error_stage = (
                        RuntimeError("boom"),
                        "sampling its next token",
                    )
                else:
                    position = item.start + len(item.token_ids)
                    result.next_id = (
                        EOS
                        if self.eos_at is not None and position >= self.eos_at
                        else 10 + position
                    )
                    result.logprob = -0.5
            results.append(result)
        return results

    def load_weights(self, model_path, load_format):
        raise self.weights_error

    def profiler_activities(self):
        import torch

        return [torch.profiler.ProfilerActivity.CPU]


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def make(num_pages=8, chunk=64, max_running=8, runner=None, tmp_path=None, **flags):
    args = ServerArgs(
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
        page_size=PAGE,
        profile_dir=str(tmp_path) if tmp_path else None,
        **flags,
    )
    runner = runner or ScriptedRunner()
    alloc = PageAllocator(num_pages, PAGE)
    kv = KVManager.build(alloc, enable_prefix_cache=not args.disable_radix_cache)
    return (
        Scheduler(args, runner, kv, StopChecker(CharTokenizer(), {EOS}, runner.context_len)),
        runner,
        alloc,
    )


def request(rid, prompt_len=4, max_new=4, **params) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=list(range(3, 3 + prompt_len)),
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, **params),
    )


def run_until_idle(s: Scheduler, max_steps=100) -> list:
    outputs = []
    for _ in range(max_steps):
        outputs += s.step()
        if not s.has_work:
            return outputs
    raise AssertionError("the scheduler never became idle")


def final(outputs, rid):
    (out,) = [o for o in outputs if o.rid == rid and o.finished_reason is not None]
    return out


def assert_pool_full(s: Scheduler, alloc: PageAllocator):
    """Nothing live holds a page: every page is free or kept only by the prefix cache, and
    flushing the cache frees them all."""
    usage = s.kv.check()
    assert usage.num_free + usage.num_evictable == alloc.num_pages == usage.num_pages
    assert usage.num_in_use == usage.num_promised == 0
    assert s.num_used_tokens() == 0
    assert not s.waiting and not s.running and s.chunked is None
    assert s.handle(FlushCacheReqInput()).success
    assert alloc.num_free_pages == alloc.num_pages


def test_a_request_prefills_decodes_and_finishes_by_length():
    s, runner, alloc = make()
    assert s.handle(request("a", prompt_len=4, max_new=3)) is None
    outputs = run_until_idle(s)
    out = final(outputs, "a")
    assert out.finished_reason == {"type": "length", "length": 3}
    assert out.new_ids == [14, 15, 16] and out.completion_tokens == 3 and out.prompt_tokens == 4
    assert [b.is_decode for b in runner.batches] == [False, True, True]
    assert_pool_full(s, alloc)


def test_eos_and_stop_token_ids_finish_with_the_matched_token():
    s, runner, alloc = make(runner=ScriptedRunner(eos_at=6))
    s.handle(request("eos", prompt_len=4, max_new=10))
    s.handle(request("stop", prompt_len=2, max_new=10, stop_token_ids=[13]))
    outputs = run_until_idle(s)
    assert final(outputs, "eos").finished_reason == {"type": "stop", "matched": EOS}
    assert final(outputs, "stop").finished_reason == {"type": "stop", "matched": 13}
    assert_pool_full(s, alloc)


def test_ignore_eos_and_min_new_tokens_keep_going():
    s, runner, alloc = make(runner=ScriptedRunner(eos_at=5))
    s.handle(request("a", prompt_len=4, max_new=3, ignore_eos=True))
    outputs = run_until_idle(s)
    assert final(outputs, "a").finished_reason == {"type": "length", "length": 3}
    # The sampler is told to mask EOS while fewer than min_new_tokens were generated.
    s.handle(request("b", prompt_len=4, max_new=5, min_new_tokens=2))
    s.step()
    assert runner.batches[-1].items[0].sampling.suppress_ids == [EOS]
    run_until_idle(s)
    assert_pool_full(s, alloc)


def test_a_request_that_does_not_fit_waits_for_memory_then_runs():
    s, runner, alloc = make(num_pages=4)  # 16 token slots
    s.handle(request("a", prompt_len=4, max_new=8))  # 12 tokens: 3 pages
    s.handle(request("b", prompt_len=4, max_new=4))  # 8 tokens: 2 pages, only 1 left
    s.step()
    assert [r.rid for r in s.running] == ["a"] and [r.rid for r in s.waiting] == ["b"]
    assert s.handle(GetLoadReqInput()).num_waiting_reqs == 1
    outputs = run_until_idle(s)
    assert final(outputs, "a").completion_tokens == 8 and final(outputs, "b").completion_tokens == 4
    first_b = next(i for i, b in enumerate(runner.batches) if any(it.rid == "b" for it in b.items))
    last_a = max(i for i, b in enumerate(runner.batches) if any(it.rid == "a" for it in b.items))
    assert first_b > last_a, "b was admitted only once a's pages came back"
    assert_pool_full(s, alloc)


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    s, runner, alloc = make(chunk=4)
    s.handle(request("a", prompt_len=10, max_new=2))
    outputs = run_until_idle(s)
    extends = [[len(i.token_ids) for i in b.items] for b in runner.batches if not b.is_decode]
    assert extends == [[4], [4], [2]]
    starts = [b.items[0].start for b in runner.batches if not b.is_decode]
    assert starts == [0, 4, 8]
    # Only the last chunk samples.
    assert [b.items[0].sampling is not None for b in runner.batches] == [False, False, True, True]
    assert final(outputs, "a").new_ids == [20, 21]  # 10 + the position after the prompt
    assert_pool_full(s, alloc)


def test_max_prefill_tokens_bounds_a_prefill_step_of_several_requests():
    """--max-prefill-tokens (SGLang's): the prompt tokens of one prefill step, all requests
    together; with chunking on, the step takes the smaller of it and the chunk size."""
    s, runner, alloc = make(num_pages=16, chunk=64, max_prefill_tokens=6)
    for rid in "abc":
        s.handle(request(rid, prompt_len=4, max_new=1))
    run_until_idle(s)
    extends = [[len(i.token_ids) for i in b.items] for b in runner.batches if not b.is_decode]
    assert extends == [[4, 2], [2, 4]]
    assert all(sum(step) <= 6 for step in extends)
    assert_pool_full(s, alloc)


def test_without_chunking_a_whole_prompt_runs_in_one_step():
    """--chunked-prefill-size -1: no prompt is split; a step takes up to the larger of
    --max-prefill-tokens and the context length (SGLang's rule), so any prompt fits."""
    s, runner, alloc = make(num_pages=32, chunk=-1, max_prefill_tokens=8, disable_radix_cache=True)
    for rid, n in (("a", 40), ("b", 30), ("c", 20)):
        s.handle(request(rid, prompt_len=n, max_new=2))
    run_until_idle(s)
    extends = [[len(i.token_ids) for i in b.items] for b in runner.batches if not b.is_decode]
    # The budget is the context (64): b does not fit beside a whole, so it waits a round.
    assert extends == [[40], [30, 20]]
    assert_pool_full(s, alloc)


def test_the_weight_version_labels_every_output_and_changes_by_control():
    """SGLang's weight version: the scheduler's own (outputs carry it); relabelling aborts
    what runs unless asked not to; a weight update that names a version takes it, one that
    fails leaves it."""
    s, runner, alloc = make(weight_version="base")
    streamed = request("a", max_new=8)
    streamed.stream = True
    s.handle(streamed)
    outputs = s.step() or s.step()  # the first token
    [msg] = to_messages(outputs, s.weight_version)
    assert msg.weight_version == "base" and msg.rids == ["a"]
    reply = s.handle(UpdateWeightVersionReqInput(new_version="v2"))
    assert reply.success and reply.new_version == "v2"
    assert final(s.step(), "a").finished_reason["type"] == "abort"
    assert s.handle(GetWeightVersionReqInput()).weight_version == "v2"
    s.handle(request("b", max_new=4))
    s.step()
    s.handle(UpdateWeightVersionReqInput(new_version="v3", abort_all_requests=False))
    outputs = run_until_idle(s)
    assert final(outputs, "b").finished_reason["type"] == "length"  # ran on
    assert to_messages(outputs, s.weight_version)[0].weight_version == "v3"
    failed = s.handle(UpdateWeightFromDiskReqInput(model_path="/nowhere", weight_version="v4"))
    assert not failed.success and s.weight_version == "v3"
    runner.load_weights = lambda path, load_format: path
    done = s.handle(UpdateWeightFromDiskReqInput(model_path="/new", weight_version="v4"))
    assert done.success and s.handle(GetWeightVersionReqInput()).weight_version == "v4"
    assert_pool_full(s, alloc)


def test_prompt_logprobs_are_asked_for_the_right_rows_across_chunks():
    s, runner, alloc = make(chunk=4)
    msg = request("a", prompt_len=7, max_new=1)
    msg.return_logprob, msg.logprob_start_len = True, 0
    s.handle(msg)
    outputs = run_until_idle(s)
    extends = [b.items[0] for b in runner.batches if not b.is_decode]
    assert [i.logprob_rows for i in extends] == [[0, 1, 2, 3], [0, 1]]
    assert sum((i.logprob_targets for i in extends), []) == msg.input_ids[1:]
    out = final(outputs, "a")
    assert [t for _, t in out.input_logprobs] == msg.input_ids and out.input_logprobs[0][0] is None


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding"])
def test_abort_anywhere_frees_everything(where):
    s, runner, alloc = make(num_pages=6, chunk=4)
    s.handle(request("big", prompt_len=12, max_new=8))  # 20 tokens: 5 pages
    s.handle(request("victim", prompt_len=6, max_new=2))  # 8 tokens: 2 pages, must wait behind big
    s.step()
    if where == "waiting":
        assert any(r.rid == "victim" for r in s.waiting)
        target = "victim"
    elif where == "prefilling":
        assert s.chunked is not None and s.chunked.rid == "big"
        target = "big"
    else:
        while not any(r.rid == "big" for r in s.running):
            s.step()
        target = "big"
    s.handle(AbortReq(rid=target, message="client left"))
    outs = s.step()
    assert final(outs, target).finished_reason == {"type": "abort", "message": "client left"}
    run_until_idle(s)
    assert_pool_full(s, alloc)


def test_a_failing_request_fails_alone():
    runner = ScriptedRunner()
    runner.fail_rids = {"bad"}
    s, runner, alloc = make(runner=runner)
    s.handle(request("good", max_new=3))
    s.handle(request("bad", max_new=3))
    outputs = run_until_idle(s)
    reason = final(outputs, "bad").finished_reason
    assert (
        reason["status_code"] == 500
        and reason["request_fault"] is True
        and "boom" in reason["message"]
    )
    assert final(outputs, "good").finished_reason == {"type": "length", "length": 3}
    assert s.num_failed_requests == 1
    assert_pool_full(s, alloc)


def test_a_request_that_cannot_be_seeded_fails_alone():
    class Unseedable(ScriptedRunner):
        def make_generator(self, seed):
            raise OverflowError("seed out of range")

    s, runner, alloc = make(runner=Unseedable())
    s.handle(request("seeded", seed=7))
    s.handle(request("plain"))
    outputs = run_until_idle(s)
    assert final(outputs, "seeded").finished_reason["status_code"] == 500
    assert final(outputs, "plain").finished_reason["type"] == "length"
    assert_pool_full(s, alloc)


def test_control_messages_through_one_table(tmp_path):
    s, runner, alloc = make(num_pages=32, tmp_path=tmp_path)
    reply = s.handle(FlushCacheReqInput(http_worker_ipc="front-0", cid="c1"))
    assert (
        isinstance(reply, FlushCacheReqOutput)
        and reply.success
        and reply.http_worker_ipc == "front-0"
        and reply.cid == "c1"  # the answer finds the caller that asked
    )
    s.handle(request("a", max_new=50))
    s.step()
    assert not s.handle(FlushCacheReqInput()).success  # refused while requests run
    load = s.handle(GetLoadReqInput())
    assert (
        isinstance(load, GetLoadReqOutput)
        and load.num_running_reqs == 1
        and load.num_used_tokens > 0
    )
    assert load.max_total_num_tokens == alloc.num_pages * PAGE
    # pause in place: nothing runs, nothing is freed
    s.handle(PauseGenerationReqInput(mode="in_place"))
    before = len(runner.batches)
    assert s.step() == [] and len(runner.batches) == before and not s.has_work
    s.handle(ContinueGenerationReqInput())
    s.step()
    assert len(runner.batches) == before + 1
    # pause retract: back to the queue, KV freed, then resumed to the end
    s.handle(PauseGenerationReqInput(mode="retract"))
    assert [r.rid for r in s.waiting] == ["a"] and s.num_used_tokens() == 0
    s.handle(ContinueGenerationReqInput())
    outputs = run_until_idle(s)
    assert final(outputs, "a").completion_tokens == 50
    # pause abort: running requests end
    s.handle(request("b", max_new=50))
    s.step()
    s.handle(PauseGenerationReqInput(mode="abort"))
    assert final(s.step(), "b").finished_reason["type"] == "abort"
    s.handle(ContinueGenerationReqInput())
    # weights: the runner's refusal is the answer, the server keeps serving
    out = s.handle(UpdateWeightFromDiskReqInput(model_path="/nowhere"))
    assert (
        isinstance(out, UpdateWeightFromDiskReqOutput)
        and not out.success
        and "no weights" in out.message
    )
    # profile: start, stop after num_steps by itself, refuse a stop with nothing running
    started = s.handle(ProfileReq(action="start", output_dir="run1", num_steps=1))
    assert isinstance(started, ProfileReqOutput) and started.success
    assert not s.handle(ProfileReq(action="start")).success  # one at a time
    s.handle(request("c", max_new=2))
    run_until_idle(s)
    assert not s.profiler.is_running and list((tmp_path / "run1").iterdir())
    assert not s.handle(ProfileReq(action="stop")).success
    assert_pool_full(s, alloc)


def test_a_control_message_that_fails_is_answered_not_raised(tmp_path):
    s, runner, alloc = make(tmp_path=tmp_path)
    out = s.handle(ProfileReq(action="start", output_dir="../escape", cid="c2"))
    assert isinstance(out, ProfileReqOutput) and not out.success and "internal error" in out.message
    assert out.cid == "c2"
    assert s.handle(object()) is None  # not a message: logged and dropped


def test_a_profile_with_start_step_starts_after_that_many_steps(tmp_path):
    s, runner, alloc = make(num_pages=32, tmp_path=tmp_path)
    started = s.handle(ProfileReq(action="start", output_dir="late", start_step=2, num_steps=1))
    assert started.success and "after 2 forward steps" in started.message
    assert not s.handle(ProfileReq(action="start")).success  # armed counts as running
    s.handle(request("a", max_new=8))
    s.step()
    assert not s.profiler.is_running and s.profiler.is_armed
    s.step()
    assert s.profiler.is_running  # two steps skipped: it runs from the third one on
    s.step()
    assert not s.profiler.is_running and list((tmp_path / "late").iterdir())  # num_steps=1
    run_until_idle(s)
    # Armed, then stopped before its first step: nothing recorded, nothing left armed.
    assert s.handle(ProfileReq(action="start", output_dir="never", start_step=5)).success
    stopped = s.handle(ProfileReq(action="stop"))
    assert stopped.success and "before it started" in stopped.message
    assert not s.profiler.is_armed and not list((tmp_path / "never").iterdir())
    assert_pool_full(s, alloc)


def order_of_admission(flags, priorities):
    s, runner, alloc = make(num_pages=3, max_running=1, **flags)  # one request at a time
    s.handle(request("first", max_new=1))
    s.step()  # "first" runs; the others queue behind it
    for rid, priority in priorities:
        msg = request(rid, max_new=1)
        msg.priority = priority
        s.handle(msg)
    run_until_idle(s)
    return [b.items[0].rid for b in runner.batches if not b.is_decode][1:]


def test_priority_scheduling_admits_higher_priorities_first():
    asked = [("low", 1), ("none", None), ("high", 9), ("high-too", 9), ("mid", 5)]
    assert order_of_admission({}, asked) == ["low", "none", "high", "high-too", "mid"]
    on = {"enable_priority_scheduling": True}
    assert order_of_admission(on, asked) == ["high", "high-too", "mid", "low", "none"]
    low_first = {**on, "schedule_low_priority_values_first": True}
    assert order_of_admission(low_first, asked) == ["low", "mid", "high", "high-too", "none"]


def test_stop_regex_ends_a_request_and_a_runaway_pattern_fails_it_alone():
    s, runner, alloc = make()
    # Outputs are tokens 14, 15, ... which CharTokenizer decodes to "o", "p", ...
    s.handle(request("stops", max_new=8, stop_regex=["p.r"]))
    s.handle(request("plain", max_new=3))
    outputs = run_until_idle(s)
    assert final(outputs, "stops").finished_reason == {"type": "stop", "matched": "p.r"}
    assert final(outputs, "stops").completion_tokens == 4  # o p q r
    assert final(outputs, "plain").finished_reason["type"] == "length"
    assert_pool_full(s, alloc)


def test_hidden_states_are_recorded_once_per_position():
    class WithHidden(ScriptedRunner):
        def run(self, batch):
            results = super().run(batch)
            for item, result in zip(batch.items, results):
                if item.return_hidden_states:
                    result.hidden_states = [
                        [float(item.start + k)] for k in range(len(item.token_ids))
                    ]
            return results

    s, runner, alloc = make(runner=WithHidden(), chunk=4)
    msg = request("h", prompt_len=6, max_new=3)
    msg.return_hidden_states = True
    s.handle(msg)
    outputs = run_until_idle(s)
    states = [v for o in outputs if o.rid == "h" and o.hidden_states for v in o.hidden_states]
    assert states == [[float(p)] for p in range(6 + 3 - 1)]  # prompt positions, then each decode


def test_stream_interval_sends_the_first_token_then_every_k_then_the_end():
    s, _, alloc = make(stream_interval=3)
    msg = request("a", prompt_len=4, max_new=8)
    msg.stream = True
    s.handle(msg)
    outputs = [o for o in run_until_idle(s) if o.rid == "a"]
    assert [len(o.new_ids) for o in outputs] == [1, 3, 3, 1]
    assert outputs[-1].finished_reason == {"type": "length", "length": 8}
    assert [t for o in outputs for t in o.new_ids] == [10 + p for p in range(4, 12)]
    assert_pool_full(s, alloc)


def test_an_abort_by_rid_reaches_the_samples_of_an_n_request_only():
    s, _, alloc = make(num_pages=64)
    for rid in ("job-0", "job-1", "job-x", "jobs-0", "other"):
        s.handle(request(rid, max_new=30))
    s.step()
    s.handle(AbortReq(rid="job"))
    ended = {o.rid for o in s.outputs if o.finished_reason}
    assert ended == {"job-0", "job-1"}  # "job-x" and "jobs-0" are other requests
    s.handle(AbortReq(abort_all=True))
    run_until_idle(s)
    assert_pool_full(s, alloc)


def test_decode_log_interval_logs_the_decode_batch_every_n_steps(caplog):
    """SGLang's --decode-log-interval: a "Decode batch" line at INFO every n decode steps
    (running requests, KV tokens held, usage, throughput, queue); 0 logs none."""
    s, runner, alloc = make(decode_log_interval=2)
    with caplog.at_level("INFO", logger="cadence.scheduler.scheduler"):
        s.handle(request("a", max_new=7))
        run_until_idle(s)
    lines = [r.getMessage() for r in caplog.records if "Decode batch" in r.getMessage()]
    decodes = sum(b.is_decode for b in runner.batches)
    assert len(lines) == decodes // 2 >= 2
    assert lines[0].startswith("Decode batch: #running-req 1, #token ")
    assert "token usage 0." in lines[0] and lines[0].endswith("#queue-req 0")
    caplog.clear()
    quiet, _, _ = make(decode_log_interval=0)
    with caplog.at_level("INFO", logger="cadence.scheduler.scheduler"):
        quiet.handle(request("b", max_new=7))
        run_until_idle(quiet)
    assert not [r for r in caplog.records if "Decode batch" in r.getMessage()]
    with pytest.raises(ValueError, match="decode_log_interval"):
        ServerArgs(decode_log_interval=-1)
