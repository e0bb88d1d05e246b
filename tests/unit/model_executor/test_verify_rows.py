"""A verify step's rows sampled at once (drafts whose rows stand alone) keep exactly what
sampling depth by depth keeps: the same tokens, logprobs and errors; rows that depend on the
tokens accepted before them (penalties, seeds) are still sampled depth by depth."""

from __future__ import annotations

import torch

from cadence.front.sampling_checks import check_sampling_params
from cadence.io_struct import SamplingParams
from cadence.layers.sampler import SamplingInput
from cadence.model_executor import step_results as sr
from cadence.model_executor.runner import BatchItem, ItemResult

VOCAB = 16


def sampling(seed=None, **params) -> SamplingInput:
    p = SamplingParams(**{"temperature": 0, **params})
    check_sampling_params(p, VOCAB)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingInput(p, [1, 2], [3], gen, None, 2, None, True)


def logits_choosing(tokens: list[int], seed: int) -> torch.Tensor:
    """Random logits whose row j has its maximum at tokens[j]."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(len(tokens), VOCAB, generator=g)
    for j, t in enumerate(tokens):
        out[j, t] = out[j].max() + 1.0 + j / 10
    return out


def step() -> tuple[list[BatchItem], torch.Tensor, list[list[int]]]:
    """Three items: one whose first two drafts are accepted, one without drafts, one whose
    first draft is refused; the tokens each should give."""
    a = BatchItem("a", 1, [9, 5, 2, 7], 10, [0, 1, 2], sampling=sampling(), num_draft=3)
    b = BatchItem("b", 2, [4], 6, [3, 4], sampling=sampling())
    c = BatchItem("c", 3, [8, 6, 6], 3, [5], sampling=sampling(), num_draft=2)
    rows = [5, 2, 3, 11] + [12] + [1, 6, 6]
    return [a, b, c], logits_choosing(rows, 0), [[5, 2, 3], [12], [1]]


def depth_by_depth(items, logits) -> list[ItemResult]:
    results = [ItemResult() for _ in items]
    starts, offset = [], 0
    for item in items:
        starts.append(offset)
        offset += 1 + item.num_draft
    sr._sample_into(results, list(range(len(items))), [i.sampling for i in items], logits[starts])
    drafted = [(i, r) for i, (item, r) in enumerate(zip(items, starts)) if item.num_draft]
    sr._verify_drafts(results, items, drafted, logits)
    return results


def tokens(results: list[ItemResult]) -> list[list[int]]:
    return [[r.next_id, *(m.next_id for m in r.more)] for r in results]


def test_rows_sampled_at_once_keep_what_depth_by_depth_keeps():
    items, logits, want = step()
    assert all(sr._stands_alone(item.sampling) for item in items)
    once = sr.results_of(items, logits)
    slow = depth_by_depth(items, logits)
    assert tokens(once) == tokens(slow) == want
    for fast, ref in zip(once, slow):
        for x, y in zip([fast, *fast.more], [ref, *ref.more]):
            assert x.logprob == y.logprob and x.top_logprobs == y.top_logprobs
            assert x.error is None and y.error is None


def test_rows_that_follow_the_accepted_tokens_are_sampled_depth_by_depth():
    """A repetition penalty counts the draft token accepted at depth 1: row 1's best token is
    that same token, so depth by depth it is penalised away; all at once it would not be."""
    item = BatchItem(
        "p", 1, [9, 5, 4], 10, [0, 1, 2], sampling=sampling(repetition_penalty=2.0), num_draft=2
    )
    logits = torch.full((3, VOCAB), -1.0)
    logits[0, 5] = 4.0  # accepted: the draft's 5
    logits[1, 5], logits[1, 7] = 4.0, 3.0  # 5 again, unless penalised (4 / 2 < 3)
    assert not sr._stands_alone(item.sampling)
    assert not sr._stands_alone(sampling(seed=3, temperature=0.7))
    got = sr.results_of([item], logits)
    assert tokens(got) == tokens(depth_by_depth([item], logits)) == [[5, 7]]


def _fit_p(counts: dict[int, int], probs: dict[int, float]) -> float:
    """The p-value of Pearson's chi-square test that `counts` were drawn from `probs`."""
    n = sum(counts.values())
    stat = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())
    stray = sum(c for t, c in counts.items() if t not in probs)
    assert stray == 0, counts  # a token the distribution cannot give
    dof = torch.tensor((len(probs) - 1) / 2.0)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2.0)))


def test_temperature_rows_sampled_at_once_give_each_token_its_own_odds():
    """Unseeded temperature sampling takes the one-shot verifier: every row of the step is
    sampled at once and a draft token is kept only where the row before sampled it. With a
    draft of fixed tokens that is the speculative-sampling rule (accept with probability
    p(draft), else take a token drawn from p without it): the first token comes from row 0's
    distribution; the second exists only after the draft's first token and comes from row 1's;
    the third only after both, from row 2's. 6,000 items of one step, each tested by a
    chi-square goodness of fit (p > 1e-6; the global generator is seeded, so the run is the
    same every time)."""
    probs = [
        {3: 0.5, 7: 0.3, 9: 0.2},  # the draft's first token (3) is likely
        {7: 0.2, 11: 0.7, 2: 0.1},  # its second (7) is not
        {4: 0.6, 5: 0.4},
    ]
    draft = [3, 7]
    rows = torch.full((3, VOCAB), float("-inf"))
    for r, dist in enumerate(probs):
        for t, p in dist.items():
            rows[r, t] = torch.tensor(p).log()
    rows += torch.randn(3, 1)  # the same odds whatever a row's level
    n = 6000
    items = [
        BatchItem(f"r{i}", i, [9, *draft], 10, [0], sampling=sampling(temperature=1.0), num_draft=2)
        for i in range(n)
    ]
    assert all(sr._stands_alone(item.sampling) for item in items)
    torch.manual_seed(34)
    got = tokens(sr.results_of(items, rows.repeat(n, 1)))
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    third: dict[int, int] = {}
    for out in got:
        first[out[0]] = first.get(out[0], 0) + 1
        if out[0] != draft[0]:
            assert len(out) == 1, out  # the draft broke at its first token
            continue
        second[out[1]] = second.get(out[1], 0) + 1
        if out[1] != draft[1]:
            assert len(out) == 2, out
            continue
        assert len(out) == 3, out  # the whole draft kept, and the row after it sampled
        third[out[2]] = third.get(out[2], 0) + 1
    assert sum(third.values()) > 300  # enough to test the last row too
    for counts, dist in ((first, probs[0]), (second, probs[1]), (third, probs[2])):
        assert _fit_p(counts, dist) > 1e-6, (counts, dist)
