"""The sampler on fabricated logits: greedy, masks, penalties, bias, suppression, seeds, logprobs."""

import math
from collections import Counter

import pytest
import torch

from cadence.front.sampling_checks import check_sampling_params
from cadence.io_struct import SamplingParams
from cadence.layers.sampler import LOGIT_LIMIT, SamplingInput, adjust_logits, argmax, sample

VOCAB = 8


def row(
    prompt=(0,),
    output=(),
    seed=None,
    suppress=None,
    top_logprobs_num=0,
    token_ids_logprob=None,
    return_logprob=False,
    **params,
) -> SamplingInput:
    p = SamplingParams(**params)
    check_sampling_params(p, VOCAB)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingInput(
        p,
        list(prompt),
        list(output),
        gen,
        suppress,
        top_logprobs_num,
        token_ids_logprob,
        return_logprob,
    )


def logits_of(*probs) -> torch.Tensor:
    """A batch of logits whose softmax is exactly the given probability rows."""
    return torch.tensor(
        [[math.log(p) if p > 0 else -1e9 for p in r] for r in probs], dtype=torch.float32
    )


# A distribution with a clear order: token 0 best, then 1, 2, ...
P = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]


def draw(num: int, **kwargs) -> Counter:
    """Samples `num` tokens one row each from P with the given parameters (seeded)."""
    rows = [row(seed=i, **kwargs) for i in range(num)]
    out = sample(logits_of(*[P] * num), rows)
    return Counter(out.next_ids)


def test_greedy_picks_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0, 0, 0, 0], [5.0, 1.0, 0, 0, 0, 0, 0, 9.0]])
    out = sample(logits.clone(), [row(temperature=0.0), row(temperature=0.0)])
    assert out.next_ids == [1, 7]


def test_tiny_temperature_is_greedy():
    out = sample(logits_of(P[::-1]), [row(temperature=1e-7, seed=0)])
    assert out.next_ids == [VOCAB - 1]


def test_top_k_one_is_greedy_even_at_high_temperature():
    counts = draw(50, temperature=2.0, top_k=1)
    assert counts == Counter({0: 50})


def test_top_k_keeps_only_the_k_best():
    counts = draw(300, temperature=1.0, top_k=2)
    assert set(counts) <= {0, 1}
    assert set(counts) == {0, 1}  # both survive, nothing else


def test_top_p_keeps_the_smallest_nucleus():
    # 0.4 + 0.25 = 0.65 < 0.7, so token 2 is still needed to reach 0.7; token 3 never is.
    counts = draw(400, temperature=1.0, top_p=0.7)
    assert set(counts) == {0, 1, 2}


def test_a_nucleus_larger_than_the_first_candidates_is_kept_whole():
    vocab = 5000  # a flat distribution: the nucleus runs past the first 256 candidates
    probs = torch.arange(vocab, 0, -1, dtype=torch.float64)
    probs /= probs.sum()
    nucleus = int(((probs.cumsum(0) - probs) < 0.5).sum())  # tokens 0 .. nucleus - 1
    assert nucleus > 1024
    rows = [
        SamplingInput(
            SamplingParams(temperature=1.0, top_p=0.5), [0], [], None, None, 0, None, False
        )
        for _ in range(400)
    ]
    picked = sample(probs.log().float().expand(400, vocab).contiguous(), rows).next_ids
    assert max(picked) < nucleus + 2  # float32 sums may move the boundary by a token
    assert max(picked) > 1024  # drawn from the whole nucleus, not the first candidates


def test_top_p_tiny_keeps_the_best_token():
    counts = draw(50, temperature=1.0, top_p=1e-6)
    assert counts == Counter({0: 50})


def test_min_p_drops_tokens_below_fraction_of_best():
    # min_p 0.3 * 0.4 = 0.12: tokens 0, 1 (0.25) and 2 (0.15) stay; 3 (0.1) and below go.
    counts = draw(400, temperature=1.0, min_p=0.3)
    assert set(counts) == {0, 1, 2}


def test_filters_combine_per_row():
    rows = [row(seed=i, top_k=1 if i % 2 else -1, min_p=0.0 if i % 2 else 0.5) for i in range(200)]
    out = sample(logits_of(*[P] * 200), rows)
    assert {t for i, t in enumerate(out.next_ids) if i % 2} == {0}
    assert {t for i, t in enumerate(out.next_ids) if not i % 2} == {0, 1}  # 0.25 >= 0.5 * 0.4


def test_unfiltered_sampling_follows_the_distribution():
    counts = draw(2000, temperature=1.0)
    # Token 0 has p = 0.4; 2000 draws put it near 800 (sd ~ 22).
    assert 680 < counts[0] < 920
    assert counts[0] > counts[1] > counts[3]


def test_unseeded_and_seeded_rows_in_one_batch_follow_the_distribution_and_skip_zeros():
    q = [0.5, 0.0, 0.3, 0.0, 0.2, 0.0, 0.0, 0.0]  # a token of probability 0 is never drawn
    rows = [row(temperature=1.0, seed=i if i % 2 else None) for i in range(3000)]
    counts = Counter(sample(logits_of(*[q] * 3000), rows).next_ids)
    assert set(counts) == {0, 2, 4}
    # 3000 draws: token 0 near 1500 (sd ~ 27), token 4 near 600 (sd ~ 22)
    assert 1380 < counts[0] < 1620 and 510 < counts[4] < 690


def test_same_seed_same_tokens_and_seeds_differ():
    def run(seeds):
        rows = [row(seed=s, temperature=1.0) for s in seeds]
        return sample(logits_of(*[[1 / VOCAB] * VOCAB] * len(seeds)), rows).next_ids

    assert run([3, 3, 3]) == [run([3])[0]] * 3
    assert len(set(run(list(range(20))))) > 1


def test_seeded_generator_stream_is_reproducible():
    def stream(seed):
        r = row(seed=seed, temperature=1.0)
        return [sample(logits_of([1 / VOCAB] * VOCAB), [r]).next_ids[0] for _ in range(20)]

    assert stream(11) == stream(11)
    assert stream(11) != stream(12)


def test_logit_bias_forces_a_token_under_greedy():
    out = sample(logits_of(P), [row(temperature=0.0, logit_bias={6: 100.0})])
    assert out.next_ids == [6]


def test_negative_logit_bias_bans_a_token():
    out = sample(logits_of(P), [row(temperature=0.0, logit_bias={0: -100.0})])
    assert out.next_ids == [1]


def test_suppress_ids_are_never_picked():
    counts = Counter(
        sample(logits_of(P), [row(seed=i, temperature=1.0, suppress=[0, 1])]).next_ids[0]
        for i in range(100)
    )
    assert 0 not in counts and 1 not in counts
    greedy = sample(logits_of(P), [row(temperature=0.0, suppress=[0])])
    assert greedy.next_ids == [1]


def test_frequency_penalty_lowers_repeated_tokens_by_count():
    logits = adjust_logits(
        torch.zeros(1, VOCAB), [row(temperature=0.0, output=[2, 2, 3], frequency_penalty=0.5)]
    )
    assert logits[0, 2].item() == pytest.approx(-1.0)
    assert logits[0, 3].item() == pytest.approx(-0.5)
    assert logits[0, 0].item() == 0.0


def test_presence_penalty_is_flat_per_present_token():
    logits = adjust_logits(
        torch.zeros(1, VOCAB), [row(temperature=0.0, output=[2, 2, 3], presence_penalty=0.7)]
    )
    assert logits[0, 2].item() == pytest.approx(-0.7)
    assert logits[0, 3].item() == pytest.approx(-0.7)
    assert logits[0, 4].item() == 0.0


def test_negative_frequency_penalty_encourages_repeats():
    logits = torch.zeros(1, VOCAB)
    out = sample(logits, [row(temperature=0.0, output=[5], frequency_penalty=-1.0)])
    assert out.next_ids == [5]


def test_penalties_change_the_greedy_choice():
    # Token 0 is best by a small margin but was already generated three times.
    logits = torch.tensor([[2.0, 1.8, 0, 0, 0, 0, 0, 0]])
    assert sample(logits.clone(), [row(temperature=0.0, output=[0, 0, 0])]).next_ids == [0]
    penalized = row(temperature=0.0, output=[0, 0, 0], frequency_penalty=0.2)
    assert sample(logits.clone(), [penalized]).next_ids == [1]


def test_repetition_penalty_pushes_seen_tokens_toward_less_likely():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0, 0, 0, 0]])
    logits = adjust_logits(
        logits, [row(prompt=[0], output=[1], temperature=0.0, repetition_penalty=2.0)]
    )
    # Seen tokens (0 in the prompt, 1 in the output) move toward -inf: positive divided,
    # negative multiplied; unseen ones (2, 3) are untouched.
    assert logits[0].tolist()[:4] == [1.0, -4.0, 2.0, -2.0]


def test_repetition_penalty_below_one_encourages_seen_tokens():
    logits = torch.tensor([[2.0, 1.5, 0, 0, 0, 0, 0, 0]])
    out = sample(logits, [row(prompt=[1], temperature=0.0, repetition_penalty=0.5)])
    assert out.next_ids == [1]  # 1.5 / 0.5 = 3.0 beats 2.0


def test_penalties_apply_only_to_rows_that_ask():
    rows = [
        row(temperature=0.0, output=[1]),
        row(temperature=0.0, output=[1], presence_penalty=1.0),
    ]
    logits = adjust_logits(torch.zeros(2, VOCAB), rows)
    assert logits[0, 1].item() == 0.0
    assert logits[1, 1].item() == pytest.approx(-1.0)


def test_logprobs_chosen_top_and_given_ids():
    logits = logits_of(P)
    r = row(temperature=0.0, return_logprob=True, top_logprobs_num=3, token_ids_logprob=[4, 7])
    out = sample(logits, [r])
    assert out.next_ids == [0]
    assert out.logprobs[0] == pytest.approx(math.log(P[0]), abs=1e-5)
    top = out.top_logprobs[0]
    assert [i for _, i in top] == [0, 1, 2]
    assert [v for v, _ in top] == pytest.approx([math.log(p) for p in P[:3]], abs=1e-5)
    assert top[0][0] == pytest.approx(out.logprobs[0])
    given = out.token_ids_logprobs[0]
    assert [i for _, i in given] == [4, 7]
    assert [v for v, _ in given] == pytest.approx([math.log(P[4]), math.log(P[7])], abs=1e-5)


def test_logprobs_are_for_the_sampled_token():
    rows = [row(seed=i, temperature=1.0, return_logprob=True) for i in range(30)]
    out = sample(logits_of(*[P] * 30), rows)
    for token, lp in zip(out.next_ids, out.logprobs):
        assert lp == pytest.approx(math.log(P[token]), abs=1e-5)


def test_no_logprobs_unless_asked():
    out = sample(logits_of(P), [row(temperature=0.0)])
    assert out.logprobs is None and out.top_logprobs is None


def test_mixed_batch_greedy_and_sampled_rows():
    rows = [
        row(temperature=0.0),
        row(seed=1, temperature=1.0, top_k=1),
        row(seed=2, temperature=1.0, suppress=[0]),
    ]
    out = sample(logits_of(P, P[::-1], P), rows)
    assert out.next_ids[0] == 0
    assert out.next_ids[1] == VOCAB - 1
    assert out.next_ids[2] != 0


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0, "logit_bias": {3: 5.0}},
        {
            "temperature": 0.0,
            "frequency_penalty": 1.0,
            "presence_penalty": 0.5,
            "repetition_penalty": 1.5,
        },
        {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "min_p": 0.1},
    ],
)
def test_logits_from_an_inference_mode_forward(params):
    # The model runs under torch.inference_mode(); its logits are inference tensors, which
    # refuse in-place updates outside that mode. The sampler edits logits in place.
    with torch.inference_mode():
        logits = logits_of(P)
    out = sample(logits, [row(output=[3, 3], seed=0, suppress=[0], return_logprob=True, **params)])
    assert out.next_ids[0] != 0
    assert len(out.logprobs) == 1


@pytest.mark.parametrize("vocab", [1, 63, 64, 100, 49152, 49155])
def test_blocked_argmax_answers_exactly_like_torch_argmax(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(12, vocab)
    logits[1] = 0.0  # all tied: the first index
    logits[2] = float("-inf")
    logits[3, vocab // 2 :] = logits[3].max() + 1  # ties spanning blocks and the partial tail
    logits[4, -1] = float("nan")  # NaN counts as the maximum
    logits[5, vocab // 3] = float("nan")
    logits[5, -1] = float("nan")
    logits[6, -1] = float("inf")
    logits[7] = torch.randint(0, 3, (vocab,)).float()  # many ties
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        assert torch.equal(argmax(x), x.argmax(-1)), dtype


def test_sample_leaves_the_callers_logits_unchanged():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0, 0, 0, 0]])
    before = logits.clone()
    sample(
        logits,
        [
            row(
                prompt=[0],
                output=[1],
                temperature=1.0,
                seed=0,
                repetition_penalty=2.0,
                logit_bias={"3": 5.0},
                frequency_penalty=1.0,
            )
        ],
    )
    assert torch.equal(logits, before)


# Parameters in range by every check whose naive math overflows float32 or divides by zero;
# each must still give a token of the vocabulary and finite log-probabilities.
EXTREMES = [
    {"repetition_penalty": 0.0, "temperature": 1.0},
    {"repetition_penalty": 5e-324, "temperature": 0.7},
    {
        "repetition_penalty": 0.0,
        "frequency_penalty": 2.0,
        "presence_penalty": 2.0,
        "temperature": 0.5,
    },
    {"logit_bias": {"1": 1e300, "2": 1e300}, "temperature": 1.0},
    {"logit_bias": {"1": -1e300, "2": 1e308}, "temperature": 1e-5},
    {"logit_bias": {"1": 1e300}, "temperature": 1e300},
    {"temperature": 1e308},
    {"temperature": 5e-324},
    {"top_p": 5e-324, "temperature": 1.0},
    {"top_p": 1e-300, "min_p": 1.0, "top_k": 1, "temperature": 3.0},
    {"min_p": 1.0, "temperature": 1.0},
    {"repetition_penalty": 0.0, "temperature": 1.0, "logit_bias": {"0": -1e300}},
]


@pytest.mark.parametrize(
    "params", EXTREMES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items())
)
def test_extreme_parameters_keep_the_math_finite(params):
    rows = [
        row(
            prompt=[0, 1, 2],
            output=[1, 2],
            seed=s,
            return_logprob=True,
            top_logprobs_num=3,
            **params,
        )
        for s in range(4)
    ]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    out = sample(logits, rows)
    assert all(0 <= t < VOCAB for t in out.next_ids)
    assert all(math.isfinite(lp) for lp in out.logprobs)
    assert all(math.isfinite(v) or v == -math.inf for top in out.top_logprobs for v, _ in top)


def test_adjusted_logits_are_clamped_and_masks_stay_minus_infinity():
    rows = [row(prompt=[1], repetition_penalty=0.0, logit_bias={"2": 1e300}, suppress=[3])]
    logits = adjust_logits(torch.tensor([[0.0, 5.0, 1.0, 1.0, 0, 0, 0, 0]]), rows)
    assert logits[0, 1].item() == pytest.approx(LOGIT_LIMIT)  # 5 / 0
    assert logits[0, 2].item() == pytest.approx(LOGIT_LIMIT)  # 1 + 1e300
    assert logits[0, 3].item() == -math.inf
    assert torch.isfinite(logits[0, [0, 4, 5, 6, 7]]).all()


def test_which_rows_sample_on_the_device():
    from cadence.layers.sampler import samples_on_device

    assert samples_on_device(row(temperature=0))
    assert samples_on_device(row(temperature=0.8))
    for r in (
        row(temperature=0.8, top_p=0.9),
        row(temperature=0.8, top_k=5),
        row(temperature=0.8, min_p=0.1),
        row(temperature=0, return_logprob=True),
        row(temperature=0.8, seed=3),  # its stream is the host generator's
        row(temperature=0, frequency_penalty=0.5, output=(1,)),
        row(temperature=0, suppress=[2]),
    ):
        assert not samples_on_device(r)


def test_device_sampling_takes_the_argmax_and_draws_by_probability():
    from cadence.layers.sampler import sample_on_device

    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    rows = [row(temperature=0)] * 3
    assert sample_on_device(logits, rows).tolist() == sample(logits, rows).next_ids
    # Greedy and sampled rows together: two equally likely tokens, drawn about evenly.
    even = torch.full((VOCAB,), -1e9)
    even[[2, 5]] = 0.0
    logits = torch.stack([torch.randn(VOCAB), even])
    counts: Counter = Counter()
    for _ in range(600):
        ids = sample_on_device(logits, [row(temperature=0), row(temperature=1.0)]).tolist()
        assert ids[0] == int(logits[0].argmax())
        counts[ids[1]] += 1
    assert set(counts) == {2, 5} and 240 < counts[2] < 360
