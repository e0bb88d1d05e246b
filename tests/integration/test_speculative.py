"""Speculative decoding (`--speculative-algorithm NGRAM`) changes how many tokens a step gives,
never which: outputs with it are byte-identical to outputs without it, greedy and seeded
sampling alike, single and batched, quantized and dense, through prefix-cache hits, stop
strings and length cuts; and nothing it drafts outlives the request (every KV page back,
the prefix cache holding only accepted tokens).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import torch

from tests.integration.conftest import _load, engine_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SPEC = {"speculative_algorithm": "NGRAM"}
GREEDY = {"temperature": 0.0, "max_new_tokens": 16}

SNIPPETS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    '{"name": "Widget", "price": 12.5, "tags": ["a", "b"], "stock": 40}',
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
]
ASKS = [
    "Repeat this exactly: {s}",
    "Copy the following text twice.\n{s}\n",
    "Rewrite this with every word in capitals: {s}",
    "Quote it back to me: {s} Quote: {s}",
    "What is {n} plus {m}?",
    "Name {n} animals that live in the sea.",
    "Write a haiku about the number {n}.",
    "Explain in one sentence why the sky is blue, version {n}.",
]


def prompts(count: int, seed: int = 34) -> list[str]:
    """Deterministic prompts: half ask to copy or edit a span (long drafts get accepted),
    half are ordinary questions (drafts mostly fail)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        ask = ASKS[i % len(ASKS)]
        out.append(ask.format(s=rng.choice(SNIPPETS), n=rng.randint(2, 99), m=rng.randint(2, 99)))
    return out


@pytest.fixture(scope="module")
def spec_engine():
    e = _load(**SPEC)
    yield e
    e.shutdown()


def texts(results) -> list[str]:
    return [r["text"] for r in results]


def assert_clean(engine) -> None:
    state = engine_state(engine)
    assert state["in_use_pages"] == 0, state
    assert state["free_pages"] == state["num_pages"], state


def test_greedy_outputs_are_identical_on_200_prompts_batched(engine, spec_engine):
    batch = prompts(200)
    params = [dict(GREEDY) for _ in batch]
    want = texts(engine.generate(batch, params))
    got = spec_engine.generate(batch, params)
    assert texts(got) == want
    drafted = [r["meta_info"] for r in got if "spec_verify_ct" in r["meta_info"]]
    assert drafted, "no request drafted anything: the check above proves nothing"
    # How much is drafted depends on the step times the cost model measures on this machine:
    # what must hold anywhere is that verified drafts were accepted.
    assert sum(m["spec_accepted_tokens"] for m in drafted) > 0
    assert_clean(spec_engine)


def test_single_requests_with_stops_and_cache_hits_are_identical(engine, spec_engine):
    cases = []
    for p in prompts(12, seed=7):
        cases.append((p, dict(GREEDY, max_new_tokens=40)))
        cases.append((p, dict(GREEDY, max_new_tokens=40, stop=[" the", "\n\n"])))
        cases.append((p, dict(GREEDY, max_new_tokens=5)))  # the cut lands inside a run
    for prompt, params in cases:  # the same prompts again: prefix-cache hits
        assert (
            spec_engine.generate(prompt, params)["text"]
            == (engine.generate(prompt, params)["text"])
        ), (prompt, params)
    assert_clean(spec_engine)


def test_seeded_sampling_with_penalties_is_identical(engine, spec_engine):
    """The verifier samples each position as a step without drafts would (the same seeded
    stream, penalties over the tokens accepted before it): the same tokens come out."""
    batch = prompts(24, seed=11)
    params = [
        {
            "temperature": 0.8,
            "top_p": 0.95,
            "seed": 1000 + i,
            "max_new_tokens": 24,
            "frequency_penalty": 0.3 if i % 2 else 0.0,
            "repetition_penalty": 1.1 if i % 3 == 0 else 1.0,
        }
        for i in range(len(batch))
    ]
    assert texts(spec_engine.generate(batch, params)) == texts(engine.generate(batch, params))


def _homogeneity_p(a: list, b: list, min_count: int = 10) -> float:
    """The p-value of Pearson's chi-square test that samples `a` and `b` come from one
    distribution; categories seen fewer than `min_count` times in all are pooled."""
    ca, cb = Counter(a), Counter(b)
    common = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= min_count]
    table = [(ca[k], cb[k]) for k in common]
    table.append((len(a) - sum(x for x, _ in table), len(b) - sum(y for _, y in table)))
    table = [row for row in table if sum(row) > 0]
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in table:
        for seen, n in ((x, na), (y, nb)):
            expected = (x + y) * n / (na + nb)
            stat += (seen - expected) ** 2 / expected
    dof = len(table) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_unseeded_sampling_draws_each_token_from_the_same_distribution(engine, spec_engine):
    """Temperature sampling without a seed takes the one-shot verifier (every row of a verify
    step sampled at once, drafts kept while they match): drafts must change only how many
    tokens a step gives, not which tokens come out with what odds. 480 answers with and
    without speculation: at each of the first positions, the tokens' frequencies are compared
    by a chi-square test of homogeneity (rare tokens pooled), which fails below p = 1e-5 (the
    nine positions together: once in 10,000 runs of a correct verifier).
    tests/unit/model_executor/test_verify_rows.py checks the rule itself, with more power."""
    line = "the cat sat on the mat, the dog lay on the rug, "
    prompt = f"Repeat this line: {line}{line}{line}"
    params = {"temperature": 1.0, "top_k": 3, "max_new_tokens": 10, "ignore_eos": True}
    # Two at a time: at small batches verifying pays for drafts accepted about half the time
    # or more, which these are (the allocator may rightly decline them at larger ones).
    count, wave = 480, 2
    outcomes: dict[str, list[list[int]]] = {"off": [], "on": []}
    verify = accepted = rejected = 0
    for _ in range(count // wave):
        for name, e in (("off", engine), ("on", spec_engine)):
            got = e.generate([prompt] * wave, params)
            outcomes[name] += [r["output_ids"] for r in got]
            if name == "on":
                for r in got:
                    meta = r["meta_info"]
                    verify += meta.get("spec_verify_ct", 0)
                    accepted += meta.get("spec_accepted_tokens", 0)
                    rejected += (meta.get("spec_acceptance_histogram") or [0])[0]
    # Draft tokens were both accepted and refused: the test saw the verifier at work.
    assert verify >= 20 and accepted >= 10 and rejected >= 5, (verify, accepted, rejected)
    worst = 1.0
    for position in range(1, 10):
        off = [ids[position] for ids in outcomes["off"]]
        on = [ids[position] for ids in outcomes["on"]]
        assert len(set(off)) > 1  # sampling, not one answer
        worst = min(worst, _homogeneity_p(off, on))
    assert worst > 1e-5, worst
    assert_clean(spec_engine)


@pytest.fixture(scope="module")
def bfloat16_engines():
    """Without and with speculation in bfloat16, the CPU default where the CPU has
    AVX512_BF16 (the engines above run float32): every projection's result is rounded to
    bfloat16, so a row whose float32 sums came out one ulp apart in a verify step would round
    apart now and then, and the greedy outputs would part ways a few dozen tokens in."""
    from cadence import Engine

    engines = [
        Engine(model_path=None, dtype="bfloat16", max_total_tokens=8192, **extra)
        for extra in ({}, SPEC)
    ]
    yield engines
    for e in engines:
        e.shutdown()


def test_long_greedy_outputs_are_identical_in_bfloat16(bfloat16_engines):
    off, on = bfloat16_engines
    params = dict(GREEDY, max_new_tokens=128, ignore_eos=True)
    batch = prompts(10, seed=91)
    got, want = [], []
    for prompt in batch:  # one stream: verify steps of one request's token and its drafts
        got.append(on.generate(prompt, params))
        want.append(off.generate(prompt, params))
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    assert sum(r["meta_info"].get("spec_accepted_tokens", 0) for r in got) > 0
    params = [dict(params) for _ in batch]  # and all at once
    assert [r["output_ids"] for r in on.generate(batch, params)] == [
        r["output_ids"] for r in off.generate(batch, params)
    ]
    assert_clean(on)


def test_logprobs_of_every_accepted_token_match(engine, spec_engine):
    params = dict(GREEDY, max_new_tokens=48)
    kwargs = {"return_logprob": True, "top_logprobs_num": 2}
    accepted = 0
    for snippet in SNIPPETS:
        prompt = "Copy the following text twice.\n" + snippet + "\n"
        want = engine.generate(prompt, params, **kwargs)["meta_info"]
        got = spec_engine.generate(prompt, params, **kwargs)["meta_info"]
        accepted += got.get("spec_accepted_tokens", 0)
        assert len(got["output_token_logprobs"]) == got["completion_tokens"]
        for (lp_got, id_got, _), (lp_want, id_want, _) in zip(
            got["output_token_logprobs"], want["output_token_logprobs"]
        ):
            assert id_got == id_want
            assert lp_got == pytest.approx(lp_want, abs=1e-3)
        assert [[i for _, i, _ in row] for row in got["output_top_logprobs"]] == [
            [i for _, i, _ in row] for row in want["output_top_logprobs"]
        ]
    assert accepted > 0, "no draft token was accepted: the check above proves nothing"


def test_metrics_say_what_the_verifier_did(spec_engine):
    prompt = "Copy the following text twice.\n" + SNIPPETS[2] * 2 + "\n"
    params = dict(GREEDY, max_new_tokens=128, ignore_eos=True)
    meta = spec_engine.generate(prompt, params)["meta_info"]
    verify, accepted, histogram = (
        meta["spec_verify_ct"],
        meta["spec_accepted_tokens"],
        meta["spec_acceptance_histogram"],
    )
    assert sum(histogram) == verify > 0
    assert sum(k * n for k, n in enumerate(histogram)) == accepted
    # Each verify step gives its accepted drafts and one sampled token; plain steps one.
    assert accepted + verify <= meta["completion_tokens"]


def test_structured_output_and_n_above_one_keep_working(spec_engine, engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = dict(GREEDY, max_new_tokens=32, json_schema=__import__("json").dumps(schema))
    prompt = "Give a JSON object with an integer a: " + SNIPPETS[1]
    assert spec_engine.generate(prompt, params)["text"] == engine.generate(prompt, params)["text"]
    many = dict(GREEDY, n=3)
    got = spec_engine.generate("Repeat this exactly: " + SNIPPETS[3], many)
    want = engine.generate("Repeat this exactly: " + SNIPPETS[3], many)
    assert texts(got) == texts(want)
    assert_clean(spec_engine)


def test_constrained_requests_draft_within_their_grammar(spec_engine, engine):
    """A request with a grammar drafts too: drafts are cut where the grammar forbids a token,
    the verifier advances the grammar through what it accepts, and the output is the one
    without speculation (SGLang crashes here: sglang#17576)."""
    line = "the cat sat on the mat. "
    params = dict(GREEDY, max_new_tokens=64, regex=f"({line})+[a-z ]*")
    prompt = f"Repeat forever: {line * 3}"
    # Fresh step costs: the engine explores (verifies) again, whatever the timings of earlier
    # tests (or a slow step on a busy machine) taught it about whether verifying pays.
    spec_engine.run_in_scheduler(lambda s: setattr(s.spec, "cost", type(s.spec.cost)()))
    got, want = spec_engine.generate(prompt, params), engine.generate(prompt, params)
    assert got["text"] == want["text"] and got["text"].startswith(line * 2)
    meta = got["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accepted_tokens"] > 0, meta
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    params = dict(GREEDY, max_new_tokens=48, json_schema=__import__("json").dumps(schema))
    prompt = 'Answer with {"a": "<the sentence>"} for the sentence: ' + line * 2
    assert spec_engine.generate(prompt, params)["text"] == engine.generate(prompt, params)["text"]
    assert_clean(spec_engine)


async def test_an_abort_in_the_middle_leaves_nothing(spec_engine):
    prompt = "Copy the following text twice.\n" + SNIPPETS[2] * 3
    endless = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}
    gen = spec_engine.async_generate(prompt, endless, stream=True, rid="spec-abort")
    chunks = 0
    async for _ in gen:
        chunks += 1
        if chunks == 5:
            break  # leaving the stream aborts the request, between verify steps or not
    await gen.aclose()
    for _ in range(100):
        if engine_state(spec_engine)["in_use_pages"] == 0:
            break
        await asyncio.sleep(0.05)
    assert_clean(spec_engine)


def test_dense_weights_too(dequantized_engine):
    spec = _load(dequantize=True, max_total_tokens=2048, **SPEC)
    try:
        batch = prompts(24, seed=5)
        params = [dict(GREEDY, max_new_tokens=24) for _ in batch]
        assert texts(spec.generate(batch, params)) == texts(
            dequantized_engine.generate(batch, params)
        )
        assert_clean(spec)
    finally:
        spec.shutdown()


def attention_of(engine) -> str:
    return engine.run_in_scheduler(lambda s: type(s.runner.attn).__name__)


def test_every_attention_path_verifies_to_the_same_text(engine, spec_engine):
    """Verify steps go through the decode attention with several rows per request: Cadence's
    kernel (the engines above) and the torch ops' path (CUDA's, and a CPU's without the
    kernels); a backend without multi-row decode verifies as a prefill instead. All three
    give the text of the engine without speculation."""
    import cadence.kernels

    batch = prompts(24, seed=9)
    params = [dict(GREEDY, max_new_tokens=24) for _ in batch]
    want = texts(engine.generate(batch, params))

    patch = pytest.MonkeyPatch()
    patch.setattr(cadence.kernels, "cpu_kernels_available", lambda: False)
    try:
        torch_ops = _load(max_total_tokens=4096, **SPEC)
    finally:
        patch.undo()
    try:
        assert attention_of(torch_ops) == "TorchNativeBackend"
        got = torch_ops.generate(batch, params)
        assert texts(got) == want
        assert sum(r["meta_info"].get("spec_accepted_tokens", 0) for r in got) > 0
        assert_clean(torch_ops)
    finally:
        torch_ops.shutdown()

    def prefill_verify(on: bool):
        def switch(s):
            # Fresh step costs: the engine explores (verifies) again, whatever earlier tests
            # taught it about which batch sizes verifying pays at.
            s.spec.cost = type(s.spec.cost)()
            if on:
                s.runner.attn.decode_takes_drafts = False  # this instance only
            else:
                del s.runner.attn.decode_takes_drafts

        spec_engine.run_in_scheduler(switch)

    prefill_verify(True)
    try:
        got = spec_engine.generate(batch, params)
    finally:
        prefill_verify(False)
    assert texts(got) == want
    assert sum(r["meta_info"].get("spec_accepted_tokens", 0) for r in got) > 0
    assert_clean(spec_engine)


def test_unknown_and_draft_model_algorithms_are_refused_at_start():
    from cadence.server_args import ServerArgs

    with pytest.raises(ValueError, match="needs a draft model"):
        ServerArgs(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="must be NGRAM"):
        ServerArgs(speculative_algorithm="MEDUSA")
