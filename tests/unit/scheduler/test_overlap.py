"""Overlap scheduling with a scripted runner that launches decode steps asynchronously:
step N+1 is launched before step N's tokens are taken, its items reading N's tokens on the
'device' (`future_row`). Outputs must equal those of the synchronous schedule, token for
token; requests that the token in flight ends run one wasted row whose result is dropped;
aborts and control messages in flight; the KV pool back to full after each."""

from __future__ import annotations

from cadence.io_struct import AbortReq, FlushCacheReqInput, GetLoadReqInput
from cadence.model_executor.runner import ItemResult, Launched, ScheduleBatch
from tests.unit.scheduler.test_scheduler import (
    EOS,
    ScriptedRunner,
    assert_pool_full,
    final,
    make,
    request,
    run_until_idle,
)


def next_token(input_token: int, position: int) -> int:
    """Depends on the input token, so a step given the wrong one answers differently."""
    return 10 + (input_token * 7 + position) % 50


class AsyncRunner(ScriptedRunner):
    """Decodes whose every item samples (and no grammar, logprobs, ...: the scheduler checks
    that) are launched, their results kept until `finish`; a future row's input is what the
    previous launch sampled at that row. Everything else runs at once, as `run`."""

    def __init__(self, eos_on: int | None = None, overlap: bool = True):
        super().__init__(context_len=64)
        self.eos_on = eos_on  # the token id after which EOS comes
        self.overlap = overlap
        self.last_ids: list[int] = []  # by row, of the last launch
        self.launches: list[ScheduleBatch] = []
        self.in_flight = 0
        self.most_in_flight = 0

    def _results(self, batch: ScheduleBatch) -> list[ItemResult]:
        results = []
        for item in batch.items:
            if item.sampling is None:
                results.append(ItemResult())
                continue
            token = item.token_ids[-1]
            if item.future_row is not None:
                assert batch.is_decode and len(item.token_ids) == 1
                token = self.last_ids[item.future_row]
            position = item.start + len(item.token_ids)
            nxt = EOS if token == self.eos_on else next_token(token, position)
            results.append(ItemResult(next_id=nxt))
        return results

    def run(self, batch):
        self.batches.append(batch)
        assert all(item.future_row is None for item in batch.items)
        return self._results(batch)

    def launch(self, batch):
        if not (self.overlap and batch.is_decode):
            return super().launch(batch)
        self.launches.append(batch)
        results = self._results(batch)
        self.last_ids = [r.next_id for r in results]
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return Launched(batch, None, results)

    def finish(self, launched):
        if launched.results is not None:
            return launched.results
        self.in_flight -= 1
        return launched.pending


def _serve(runner, reqs, **make_kw):
    s, _, alloc = make(runner=runner, num_pages=32, **make_kw)
    for r in reqs:
        assert s.handle(r) is None
    outputs = run_until_idle(s)
    assert_pool_full(s, alloc)
    return {r.rid: final(outputs, r.rid) for r in reqs}


def _requests():
    return [
        request("a", prompt_len=4, max_new=9),
        request("b", prompt_len=6, max_new=3),
        request("c", prompt_len=3, max_new=12),
        request("d", prompt_len=5, max_new=1),
    ]


def test_overlapped_decode_gives_the_synchronous_outputs():
    ours = AsyncRunner()
    got = _serve(ours, _requests())
    want = _serve(AsyncRunner(overlap=False), _requests())
    assert {k: (v.new_ids, v.finished_reason) for k, v in got.items()} == {
        k: (v.new_ids, v.finished_reason) for k, v in want.items()
    }
    assert [len(got[r].new_ids) for r in "abcd"] == [9, 3, 12, 1]
    assert ours.most_in_flight == 2  # N+1 launched before N was taken
    assert any(i.future_row is not None for b in ours.launches for i in b.items)
    # A request whose last token is in flight is left out of the step after it.
    for batch in ours.launches:
        for item in batch.items:
            if item.rid == "b":
                assert item.start <= 6 + 3 - 2


def test_a_stop_found_in_flight_drops_the_wasted_row():
    token_before_eos = next_token(next_token(6, 4), 5)  # a's third output token
    ours = AsyncRunner(eos_on=token_before_eos)
    got = _serve(ours, [request("a", prompt_len=4, max_new=20)])
    want = _serve(
        AsyncRunner(eos_on=token_before_eos, overlap=False),
        [request("a", prompt_len=4, max_new=20)],
    )
    assert got["a"].new_ids == want["a"].new_ids
    assert got["a"].finished_reason == {"type": "stop", "matched": EOS}
    # The row after EOS ran (launched before EOS was seen), and changed nothing.
    # (EOS came from the step at position 5; the step at 6 ran on it, wasted.)
    assert max(b.items[0].start for b in ours.launches) == 4 + len(got["a"].new_ids) - 1


def test_an_abort_and_control_messages_while_a_step_is_in_flight():
    runner = AsyncRunner()
    s, _, alloc = make(runner=runner, num_pages=32)
    s.handle(request("a", prompt_len=4, max_new=30))
    s.handle(request("b", prompt_len=4, max_new=30))
    while not s.inflight:
        s.step()
    s.handle(AbortReq(rid="a"))  # handled in flight: a ends now, its rows are dropped
    assert s.inflight
    assert s.handle(GetLoadReqInput()).num_running_reqs == 1
    outputs = s.step()
    assert final(outputs, "a").finished_reason["type"] == "abort"
    assert all(i.rid == "b" for i in s.inflight[0][0].batch.items)
    # A flush waits for the step in flight first (then refuses: b is still running).
    assert s.handle(FlushCacheReqInput()) is not None and not s.inflight
    outputs = run_until_idle(s)
    assert len(final(outputs, "b").new_ids) == 30
    assert_pool_full(s, alloc)


def test_requests_that_need_the_host_are_not_scheduled_ahead():
    runner = AsyncRunner()
    got = _serve(
        runner,
        [
            request("a", prompt_len=4, max_new=6),
            request("b", prompt_len=4, max_new=6, min_new_tokens=4),
            request("c", prompt_len=4, max_new=6, frequency_penalty=0.5),
        ],
    )
    assert all(len(got[r].new_ids) == 6 for r in "abc")
    ahead = [b for b in runner.launches if any(i.future_row is not None for i in b.items)]
    # While b's min_new_tokens is in force, and whenever c (a penalty) runs, nothing goes ahead.
    assert not any(i.rid == "c" for b in ahead for i in b.items)


class SpeculatingRunner(AsyncRunner):
    """An AsyncRunner whose tokens repeat with a period of 5 from position REPEATS_FROM (so
    n-gram drafts match there, and nowhere before), and which verifies drafts in `run`:
    each row samples what its input token gives, and draft tokens are kept while they are
    what the row before sampled."""

    REPEATS_FROM = 24

    @classmethod
    def token(cls, input_token: int, position: int) -> int:
        if position >= cls.REPEATS_FROM:
            return 60 + position % 5
        return next_token(input_token, position)

    def _results(self, batch):
        results = []
        for item in batch.items:
            if item.sampling is None:
                results.append(ItemResult())
                continue
            first = item.token_ids[0]
            if item.future_row is not None:
                first = self.last_ids[item.future_row]
            result = ItemResult(next_id=self.token(first, item.start + 1))
            for d in range(1, 1 + item.num_draft):
                last = (result.more or [result])[-1].next_id
                if last != item.token_ids[d]:
                    break
                result.more.append(ItemResult(next_id=self.token(last, item.start + d + 1)))
            results.append(result)
        return results


def test_speculation_verifies_now_and_lets_undrafted_steps_go_ahead():
    """With speculation on, a step with drafts runs at once (the next drafts need its tokens);
    a step without may fly, and steps go ahead of it before the drafter looks again: 2,
    then doubling while it finds nothing, up to STEPS_AHEAD. Outputs are those of the plain
    synchronous schedule."""
    from cadence.scheduler.speculative import STEPS_AHEAD

    def reqs():
        return [request("a", prompt_len=4, max_new=60), request("b", prompt_len=5, max_new=45)]

    ours = SpeculatingRunner()
    got = _serve(ours, reqs(), speculative_algorithm="NGRAM")
    want = _serve(SpeculatingRunner(overlap=False), reqs())
    assert {k: v.new_ids for k, v in got.items()} == {k: v.new_ids for k, v in want.items()}
    verified = [b for b in ours.batches if any(i.num_draft for i in b.items)]
    assert verified and not any(b in ours.launches for b in verified)
    runs, run = [], 0  # launches in a row that went ahead of the one before
    for batch in ours.launches:
        run = run + 1 if any(i.future_row is not None for i in batch.items) else 0
        runs.append(run)
    chains = [r for r, after in zip(runs, [*runs[1:], 0]) if r and not after]  # each run's end
    assert chains[:3] == [2, 4, 8] and max(chains) == STEPS_AHEAD
