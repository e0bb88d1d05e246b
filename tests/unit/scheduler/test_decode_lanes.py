"""Decode lanes (pipeline stages): a runner with `decode_lanes` > 1 keeps that many decodes of
disjoint running requests in flight, launched before the oldest one's tokens are taken, and
finished in launch order. Outputs must equal the synchronous schedule's token for token;
every running request is in exactly one lane; a new prompt, a pause or a control message
takes every lane back; the KV pool is back to full after each."""

from __future__ import annotations

from cadence.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    PauseGenerationReqInput,
)
from cadence.model_executor.runner import ItemResult, Launched, ScheduleBatch
from tests.unit.scheduler.test_scheduler import (
    ScriptedRunner,
    assert_pool_full,
    final,
    make,
    request,
    run_until_idle,
)


class LaneRunner(ScriptedRunner):
    """Decodes of one token per item are launched (results kept until `finish`, which must
    come in launch order); everything else runs at once. Records what flew together."""

    def __init__(self, lanes: int = 2):
        super().__init__(context_len=64)
        self.decode_lanes = lanes
        self.flying: list[Launched] = []
        self.most_in_flight = 0
        self.launches: list[ScheduleBatch] = []
        self.ran_while_flying = 0

    def run(self, batch: ScheduleBatch) -> list[ItemResult]:
        if self.flying:
            self.ran_while_flying += 1
        return super().run(batch)

    def launch(self, batch: ScheduleBatch) -> Launched:
        if not (batch.is_decode and all(len(i.token_ids) == 1 for i in batch.items)):
            return super().launch(batch)
        rids = {item.rid for item in batch.items}
        for other in self.flying:  # lanes never share a request
            assert not rids & {item.rid for item in other.batch.items}
        launched = Launched(batch, None, super().run(batch))
        self.launches.append(batch)
        self.flying.append(launched)
        self.most_in_flight = max(self.most_in_flight, len(self.flying))
        return launched

    def finish(self, launched: Launched) -> list[ItemResult]:
        if launched.results is not None:
            return launched.results
        assert self.flying[0] is launched, "lanes finish in the order they were launched"
        self.flying.pop(0)
        return launched.pending


def _requests():
    return [
        request("a", prompt_len=4, max_new=9),
        request("b", prompt_len=6, max_new=3),
        request("c", prompt_len=3, max_new=12),
        request("d", prompt_len=5, max_new=1),
        request("e", prompt_len=2, max_new=7),
    ]


def _serve(runner, reqs):
    s, _, alloc = make(runner=runner, num_pages=32)
    for r in reqs:
        assert s.handle(r) is None
    outputs = run_until_idle(s, max_steps=200)
    assert_pool_full(s, alloc)
    return {r.rid: (final(outputs, r.rid).new_ids, final(outputs, r.rid).finished_reason)
            for r in reqs}  # fmt: skip


def test_lanes_give_the_synchronous_outputs_with_each_request_in_one_lane():
    for lanes in (2, 3):
        ours = LaneRunner(lanes)
        got = _serve(ours, _requests())
        assert got == _serve(ScriptedRunner(context_len=64), _requests())
        assert [len(got[r][0]) for r in "abcde"] == [9, 3, 12, 1, 7]
        assert ours.most_in_flight == lanes
        assert ours.ran_while_flying == 0  # nothing else ran through the stages meanwhile
        # The first launches cut the running requests into even lanes (d's one token came
        # from its prefill: four decode).
        sizes = [len(b.items) for b in ours.launches[:lanes]]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 4


def test_a_prompt_that_waits_for_memory_leaves_the_lanes_flying():
    """Admission took nothing and no request came or ended since: the queue cannot move, so
    the lanes stay in flight; once one ends, the prompt gets in and the lanes are cut
    again with it."""
    ours = LaneRunner(2)
    s, _, alloc = make(runner=ours, num_pages=32)  # d waits for a, b or c to end
    for rid in "abc":
        s.handle(request(rid, prompt_len=4, max_new=30))
    s.handle(request("d", prompt_len=4, max_new=30))
    outputs, flying_while_waiting = [], 0
    for _ in range(400):
        outputs += s.step()
        if s.waiting:
            flying_while_waiting = max(flying_while_waiting, ours.most_in_flight)
        if not s.has_work:
            break
    assert flying_while_waiting == 2
    for rid in "abcd":
        assert len(final(outputs, rid).new_ids) == 30
    assert ours.ran_while_flying == 0
    assert_pool_full(s, alloc)


def test_each_fresh_cut_starts_with_the_requests_that_decoded_longest_ago():
    """Lanes taken back at every step are cut afresh each time, by turn: a rotation, so no
    request decodes less often than the others."""
    ours = LaneRunner(2)
    s, _, alloc = make(runner=ours, num_pages=64)
    for rid in "abc":
        s.handle(request(rid, prompt_len=4, max_new=30))
    while not s.running:
        s.step()
    for _ in range(6):  # nothing flies longer than a step: every decode is a fresh cut
        s.step()
        s.drain()
    cuts = [[i.rid for i in b.items] for b in ours.launches[:6]]
    counts = {rid: sum(rid in cut for cut in cuts) for rid in "abc"}
    assert max(counts.values()) - min(counts.values()) <= 1, cuts
    outputs = run_until_idle(s, max_steps=400)
    for rid in "abc":
        assert len(final(outputs, rid).new_ids) == 30
    assert_pool_full(s, alloc)


def test_a_single_request_decodes_alone_step_after_step():
    ours = LaneRunner(2)
    got = _serve(ours, [request("a", prompt_len=4, max_new=6)])
    assert len(got["a"][0]) == 6
    assert ours.most_in_flight == 1


def test_a_new_prompt_takes_the_lanes_back_and_they_are_cut_again():
    ours = LaneRunner(2)
    s, _, alloc = make(runner=ours, num_pages=32)
    for rid in "ab":
        s.handle(request(rid, prompt_len=4, max_new=20))
    while ours.most_in_flight < 2:  # both lanes have flown; one is in flight between steps
        s.step()
    assert len(s.inflight) == 1
    s.handle(request("c", prompt_len=4, max_new=20))
    s.step()  # takes the lanes back, prefills nothing yet
    assert not s.inflight and not ours.flying
    outputs = run_until_idle(s, max_steps=200)
    assert ours.ran_while_flying == 0
    # After c joined, three requests were cut into lanes of two and one.
    later = [len(b.items) for b in ours.launches if any(i.rid == "c" for i in b.items)]
    assert later and all(n in (1, 2) for n in later)
    for rid in "abc":
        assert len(final(outputs, rid).new_ids) == 20
    assert_pool_full(s, alloc)


def test_an_abort_a_pause_and_a_flush_while_lanes_fly():
    ours = LaneRunner(2)
    s, _, alloc = make(runner=ours, num_pages=64)  # all four admitted at once
    for rid in "abcd":
        s.handle(request(rid, prompt_len=4, max_new=30))
    while ours.most_in_flight < 2:
        s.step()
    assert not s.waiting and len(s.running) == 4
    s.handle(AbortReq(rid="a"))  # in flight: a ends now, its row is dropped when it lands
    outputs = s.step()
    assert final(outputs, "a").finished_reason["type"] == "abort"
    s.handle(PauseGenerationReqInput(mode="in_place"))  # takes every lane back
    assert not s.inflight
    s.step()
    assert not ours.flying
    s.handle(ContinueGenerationReqInput())
    for _ in range(3):
        if not s.inflight:
            s.step()
    assert s.inflight
    assert s.handle(FlushCacheReqInput()) is not None and not s.inflight
    outputs = run_until_idle(s, max_steps=200)
    for rid in "bcd":
        assert len(final(outputs, rid).new_ids) == 30
    assert ours.ran_while_flying == 0
    assert_pool_full(s, alloc)
