"""The n-gram drafter: prompt lookup in a request's own tokens (longest suffix match, the
most recent occurrence on ties), the shared store of finished outputs (BFS: the most
recent continuation, PROB: the most frequent; bounded), and the drafting pace."""

from __future__ import annotations

import pytest

from cadence.scheduler.ngram import DraftPace, NgramConfig, NgramDrafter


def config(**changes) -> NgramConfig:
    base = dict(
        num_draft_tokens=6,
        min_match_window=1,
        max_match_window=4,
        max_bfs_breadth=3,
        match_type="BFS",
        branch_length=8,
        capacity=1000,
    )
    return NgramConfig(**{**base, **changes})


def test_the_longest_suffix_match_wins_and_its_continuation_is_drafted():
    d = NgramDrafter(config())
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 8, 7, 2, 3, 4, 5, 1, 2, 3]
    # "1 2 3" occurs at 0 (followed by 9 8 7 ...); "2 3" also at 6 (followed by 4 5): the
    # longer match is the better evidence.
    assert d.draft(tokens, 4) == [9, 8, 7, 2]


def test_the_most_recent_occurrence_wins_a_tie_and_limits_hold():
    d = NgramDrafter(config())
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert d.draft(tokens, 1) == [2]
    assert d.draft(tokens, 0) == []
    assert len(d.draft(tokens, 99)) <= 5  # num_draft_tokens counts the verified token


def test_no_match_no_draft():
    d = NgramDrafter(config(min_match_window=2))
    assert d.draft([1, 2, 3, 4], 4) == []
    assert d.draft([7], 4) == []


@pytest.mark.parametrize("match_type, want", [("BFS", [30, 31]), ("PROB", [20, 21])])
def test_the_store_drafts_by_recency_or_frequency(match_type, want):
    d = NgramDrafter(config(match_type=match_type, min_match_window=2))
    for tail in ([20, 21], [20, 21], [30, 31]):
        d.remember([100, 101, 7, 8, *tail], start=2)
    # The request itself has never seen 7 8: the store answers.
    assert d.draft([55, 7, 8], 2) == want


def test_the_longer_match_drafts_whichever_source_it_comes_from():
    d = NgramDrafter(config(min_match_window=1, max_match_window=6))
    d.remember([100, 4, 5, 6, 70, 71], start=1)  # the store saw "4 5 6" followed by 70 71
    # The request's own match is "6" alone (followed by 9 9); the store's is "4 5 6".
    assert d.draft([6, 9, 9, 4, 5, 6], 2) == [70, 71]
    # A tie in length goes to the request's own tokens: "5 6" at 0 is followed by 8 8.
    assert d.draft([5, 6, 8, 8, 3, 5, 6], 2) == [8, 8]
    # An own match as long as the store's longest key needs no store lookup, and wins.
    assert d.draft([1, 4, 5, 6, 60, 61, 2, 1, 4, 5, 6], 2) == [60, 61]


def test_the_store_forgets_the_least_recently_used_beyond_its_capacity():
    d = NgramDrafter(config(capacity=10, min_match_window=2, max_match_window=2))
    for i in range(50):
        d.remember([1000 + i, 2000 + i, 3000 + i, 4000 + i], start=0)
    assert d.store_size <= 10
    assert d.draft([9, 1049, 2049], 2) == [3049, 4049]  # the newest is still there
    d.clear()
    assert d.store_size == 0


def test_the_pace_backs_off_after_misses_and_grows_after_hits():
    pace = DraftPace(length=8)
    pace.update(proposed=8, accepted=0, max_draft=8)
    assert pace.length == 4 and pace.wait == 1
    assert not pace.drafting() and pace.drafting()
    pace.update(proposed=4, accepted=0, max_draft=8)
    assert pace.length == 2 and pace.wait == 3
    pace.update(proposed=2, accepted=2, max_draft=8)  # all right: draft twice as far
    assert pace.length == 4 and pace.misses == 0
    pace.update(proposed=4, accepted=4, max_draft=8)
    pace.update(proposed=8, accepted=8, max_draft=8)
    assert pace.length == 8
    pace.update(proposed=8, accepted=1, max_draft=8)  # partly right: a little past that
    assert pace.length == 3


def _speculation(plain_s: float, verify_a: float, verify_m: float):
    from cadence.scheduler.req import Req
    from cadence.scheduler.speculative import EXPLORE_STEPS, Speculation
    from cadence.server_args import ServerArgs

    spec = Speculation(ServerArgs(speculative_algorithm="NGRAM"), context_len=4096)
    for n in (1, 2):
        spec.cost.observe(n, plain_s, verified=False)
    for n in range(2, 2 + EXPLORE_STEPS):
        spec.cost.observe(n, verify_a + verify_m * n, verified=True)
        spec.cost.observe(1, plain_s, verified=False)  # costs nothing beyond a plain step

    def req(p: float):
        r = Req(rid=f"r{p}", input_ids=[1, 2, 3], params=None)  # type: ignore[arg-type]
        r.spec_pace = DraftPace(length=11, hits=100 * p, breaks=100 * (1 - p))
        return r

    return spec, req


def test_drafts_are_verified_as_far_as_they_pay_and_not_at_all_when_they_do_not():
    spec, req = _speculation(plain_s=0.015, verify_a=0.010, verify_m=0.005)
    likely, unlikely = req(0.95), req(0.3)
    keep = spec._allocate([likely, unlikely], [[7] * 11, [8] * 11])
    assert keep.get(0, 0) >= 6  # a draft that is nearly always right goes far
    assert keep.get(1, 0) <= 1  # one that is mostly wrong is cut to almost nothing
    spec, req = _speculation(plain_s=0.015, verify_a=0.040, verify_m=0.005)
    assert spec._allocate([req(0.5)], [[7] * 11]) == {}  # verifying costs more than it gives


def test_a_plain_step_after_a_verify_step_bills_its_extra_to_the_verify():
    from cadence.scheduler.speculative import StepCost

    cost = StepCost()
    cost.observe(1, 0.015, verified=False)
    cost.observe(5, 0.030, verified=True)
    cost.observe(1, 0.025, verified=False)  # the decode state restarts: 10 ms more
    assert list(cost.verify) == [(5, pytest.approx(0.040))]
    assert list(cost.plain) == [(1, 0.015)] and cost.plain_streak == 1


def test_a_batch_size_whose_verify_steps_gave_less_stops_verifying():
    """The lines say verifying pays (a cheap extra token, likely drafts); what verify steps
    of batch 8 actually gave says otherwise: that size stops verifying, batch 1 does not."""
    spec, req = _speculation(plain_s=0.015, verify_a=0.010, verify_m=0.001)
    reqs = [req(0.9) for _ in range(8)]
    drafts = [[7] * 4 for _ in reqs]
    assert spec._allocate(reqs, drafts)
    cost = spec.cost
    cost.observe(8, 0.040, verified=False, batch=8, emitted=8)  # 200 tokens/s
    cost.observe(20, 0.080, verified=True, batch=8, emitted=12)  # 150 tokens/s
    cost.observe(1, 0.015, verified=False, batch=1, emitted=1)
    cost.observe(3, 0.017, verified=True, batch=1, emitted=3)
    assert not cost.verify_pays(8) and cost.verify_pays(1) and cost.verify_pays(4)
    assert spec._allocate(reqs, drafts) == {}
    assert spec._allocate(reqs[:1], drafts[:1])


def test_the_recent_window_keeps_its_sums_as_old_steps_leave():
    from cadence.scheduler.speculative import RECENT_VERIFIES, SpecStats

    stats = SpecStats()
    for _ in range(RECENT_VERIFIES):
        stats.add(4, 0)
    for _ in range(RECENT_VERIFIES):
        stats.add(2, 1)
    assert (stats.recent_proposed, stats.recent_accepted) == (2 * RECENT_VERIFIES, RECENT_VERIFIES)
    assert stats.prior == 0.5 and stats.verify_steps == 2 * RECENT_VERIFIES


class RollbackGrammar:
    """Allows the tokens of `allowed`, ends after `length`; rolls back."""

    supports_rollback = True

    def __init__(self, allowed: set[int], length: int = 100):
        self.allowed, self.length = allowed, length
        self.accepted: list[int] = []

    def accept(self, token):
        if token not in self.allowed:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self):
        return len(self.accepted) >= self.length

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n :]


def test_a_draft_token_the_grammar_forbids_ends_the_draft():
    from cadence.scheduler.speculative import grammar_allowed

    g = RollbackGrammar({1, 2, 3})
    g.accepted = [7]  # where the request is
    assert grammar_allowed(g, [1, 2, 9, 3]) == [1, 2]
    assert g.accepted == [7]  # left where it was
    assert grammar_allowed(g, [9, 1]) == []
    # The grammar's end ends the draft too.
    g = RollbackGrammar({1, 2, 3}, length=2)
    assert grammar_allowed(g, [1, 2, 3]) == [1, 2] and g.accepted == []


def test_a_pace_backing_off_resumes_when_the_draft_it_follows_comes_true():
    pace = DraftPace(length=8)
    pace.update(proposed=8, accepted=0, max_draft=8)
    pace.update(proposed=4, accepted=0, max_draft=8)
    assert pace.wait == 3 and pace.misses == 2 and pace.length == 2
    pace.follow([5, 6, 7])
    pace.sampled(5)
    pace.sampled(9)  # one token matched, then it broke: not evidence enough
    assert pace.wait == 3 and not pace.shadow
    pace.follow([5, 6, 7])
    pace.sampled(5)
    pace.sampled(6)  # two tokens came true: the request copies again
    assert pace.wait == 0 and pace.length == 4 and not pace.shadow
    pace.update(proposed=4, accepted=0, max_draft=8)  # it was chance: the next wait is longer
    assert pace.misses == 3 and pace.wait == 7


def test_a_request_backing_off_still_looks_and_drafts_as_soon_as_it_copies_again():
    """While its pace waits, the drafter still looks (the step verifies nothing) and the
    pace follows what it found; once that comes true, the next step drafts."""
    from cadence.io_struct import SamplingParams
    from cadence.scheduler.req import Req
    from cadence.scheduler.speculative import Speculation
    from cadence.server_args import ServerArgs

    spec = Speculation(ServerArgs(speculative_algorithm="NGRAM"), context_len=4096)
    quote = list(range(100, 140))
    req = Req(rid="r", input_ids=[1, 2, *quote, 3], params=SamplingParams(max_new_tokens=64))
    req.spec_pace = DraftPace(length=8, wait=20, misses=4)
    for token in quote[:2]:  # the answer starts quoting the prompt
        req.output_ids.append(token)
        (draft,) = spec.drafts([req], lambda r: None)
        assert draft == []  # backing off: nothing verified
        assert req.spec_pace.shadow[0] == quote[len(req.output_ids)]  # but it looked
        spec.sampled(req, quote[len(req.output_ids)])
    assert req.spec_pace.wait == 0
    req.output_ids.extend(quote[2:4])
    (draft,) = spec.drafts([req], lambda r: None)
    assert len(draft) >= 2 and draft == quote[4 : 4 + len(draft)]


def test_exploring_verifies_the_likeliest_draft_even_where_the_estimates_keep_none():
    """Where a draft token's estimated gain is below what it costs (a steep verify line, a
    low acceptance), no token is kept; if exploring kept none either, no verify step would
    ever come to correct the line or the acceptance record. Every EXPLORE_EVERY plain steps
    the likeliest draft is verified whole."""
    from cadence.scheduler.speculative import EXPLORE_EVERY

    spec, req = _speculation(plain_s=0.015, verify_a=0.001, verify_m=0.004)
    reqs = [req(0.2) for _ in range(7)] + [req(0.4)]
    drafts = [[7] * 5 for _ in reqs]
    assert spec._allocate(reqs, drafts) == {}  # not worth it, by the estimates
    for _ in range(EXPLORE_EVERY):
        spec.cost.observe(8, 0.03, verified=False)
    assert spec.cost.exploring
    assert spec._allocate(reqs, drafts) == {7: 5}
