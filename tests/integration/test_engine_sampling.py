"""Sampling parameters end to end through the in-process Engine on the real model."""

from __future__ import annotations

import time

import pytest

from cadence.errors import InvalidParameter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = "The capital of France is"
EOS = 2  # <|im_end|>
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy 16-token continuation of PROMPT: the ground truth the stop tests cut into."""
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 16})
    assert len(out["output_ids"]) == 16
    return out


def test_same_seed_same_text_different_seeds_differ(engine):
    params = [
        {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "seed": s}
        for s in (7, 7, 8, 9, 10, 11)
    ]
    outs = engine.generate([PROMPT] * len(params), params)
    again = engine.generate(PROMPT, params[0])
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == again["output_ids"]
    assert outs[0]["text"] == again["text"]
    distinct = {tuple(o["output_ids"]) for o in outs[1:]}
    assert len(distinct) >= 3, "five different seeds gave (almost) the same sample"


def test_stop_string_trimmed_with_finish_reason(engine, reference):
    text = reference["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0
    out = engine.generate(
        PROMPT, {**GREEDY, "max_new_tokens": 16, "stop": [stop, "unlikely-stop-xyz"]}
    )
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(out["output_ids"]) < 16
    assert out["output_ids"] == reference["output_ids"][: len(out["output_ids"])]


def test_stop_string_kept_with_no_stop_trim(engine, reference):
    text = reference["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = engine.generate(
        PROMPT, {**GREEDY, "max_new_tokens": 16, "stop": stop, "no_stop_trim": True}
    )
    assert out["text"].startswith(text[: text.index(stop) + len(stop)])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_string_ignored_before_min_new_tokens(engine, reference):
    # The reference holds "\n" in (at least) two tokens. With min_new_tokens past the first,
    # that one stays in the text and the next one ends the request.
    ids = reference["output_ids"]
    pieces = [engine.tokenizer.decode([t]) for t in ids]
    positions = [k for k, piece in enumerate(pieces) if "\n" in piece]
    assert len(positions) >= 2, reference["text"]
    min_new = positions[0] + 2  # the first "\n" arrives as token number positions[0] + 1
    end = positions[1]
    out = engine.generate(
        PROMPT, {**GREEDY, "max_new_tokens": 16, "stop": "\n", "min_new_tokens": min_new}
    )
    assert out["output_ids"] == ids[: end + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n"}
    assert out["text"] == "".join(pieces[:end]) + pieces[end].split("\n")[0]
    assert out["text"].count("\n") == 1


def test_stop_string_of_multibyte_characters(engine):
    # Japanese output: each character here takes two byte-level tokens, so a three-character
    # stop string spans six tokens.
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Translate to Japanese: good morning"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    params = {**GREEDY, "max_new_tokens": 16}
    whole = engine.generate(prompt, params)["text"].rstrip("\ufffd")
    stop = whole[3:6]
    assert len(stop) == 3 and all(ord(c) > 0x3000 for c in stop), whole
    out = engine.generate(prompt, {**params, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == whole[: whole.index(stop)]


async def test_stop_string_streamed_never_leaks(engine, reference):
    text = reference["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    chunks = [
        c
        async for c in engine.async_generate(
            PROMPT, {**GREEDY, "max_new_tokens": 16, "stop": stop}, stream=True
        )
    ]
    assert "".join(c["text"] for c in chunks) == text[: text.index(stop)]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_token_ids(engine, reference):
    ids = reference["output_ids"]
    k = 3
    token = ids[k]
    first = ids.index(token)  # the earliest occurrence ends generation
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 16, "stop_token_ids": [token]})
    assert out["output_ids"] == ids[: first + 1]  # the stop token is reported ...
    assert out["text"] == engine.tokenizer.decode(ids[:first])  # ... but not in the text
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert out["meta_info"]["completion_tokens"] == first + 1


def test_max_new_tokens_zero(engine):
    out = engine.generate(PROMPT, {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(PROMPT))


def test_length_finish_reason(engine):
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 5})
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_logit_bias_forces_a_token(engine):
    token = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = engine.generate(
        PROMPT, {**GREEDY, "max_new_tokens": 4, "logit_bias": {str(token): 100.0}}
    )
    assert out["output_ids"] == [token] * 4
    sampled = engine.generate(
        PROMPT,
        {
            "temperature": 1.0,
            "max_new_tokens": 4,
            "ignore_eos": True,
            "logit_bias": {token: 100.0},
            "seed": 1,
        },
    )
    assert sampled["output_ids"] == [token] * 4


def test_eos_ends_generation_and_min_new_tokens_holds_it_off(engine):
    force_eos = {"temperature": 0.0, "max_new_tokens": 16, "logit_bias": {EOS: 100.0}}
    out = engine.generate(PROMPT, force_eos)
    assert out["output_ids"] == [EOS]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["text"] == ""
    held = engine.generate(PROMPT, {**force_eos, "min_new_tokens": 5})
    assert len(held["output_ids"]) == 6
    assert EOS not in held["output_ids"][:5] and held["output_ids"][5] == EOS
    assert held["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    ignored = engine.generate(PROMPT, {**force_eos, "ignore_eos": True, "max_new_tokens": 3})
    assert ignored["output_ids"] == [EOS] * 3
    assert ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_min_new_tokens_holds_off_stop_token_ids(engine, reference):
    token = reference["output_ids"][0]
    params = {**GREEDY, "max_new_tokens": 8, "stop_token_ids": [token], "min_new_tokens": 4}
    out = engine.generate(PROMPT, params)
    assert len(out["output_ids"]) >= 4
    assert token not in out["output_ids"][:4]


def test_top_k_one_equals_greedy(engine, reference):
    out = engine.generate(
        PROMPT, {"temperature": 1.5, "top_k": 1, "max_new_tokens": 16, "ignore_eos": True}
    )
    assert out["output_ids"] == reference["output_ids"]


def test_tiny_top_p_equals_greedy(engine, reference):
    out = engine.generate(
        PROMPT, {"temperature": 1.0, "top_p": 1e-6, "max_new_tokens": 16, "ignore_eos": True}
    )
    assert out["output_ids"] == reference["output_ids"]


REPETITIVE = "Repeat after me: la la la la la la la la"


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"repetition_penalty": 1.8}])
def test_penalties_break_a_repetition(engine, penalty):
    params = {**GREEDY, "max_new_tokens": 12}
    plain = engine.generate(REPETITIVE, params)
    la = engine.tokenizer.encode(" la", add_special_tokens=False)
    assert plain["output_ids"] == la * 12  # greedy repeats forever
    penalized = engine.generate(REPETITIVE, {**params, **penalty})
    assert len(penalized["output_ids"]) == 12
    assert penalized["output_ids"].count(la[0]) < 6


def test_negative_presence_penalty_keeps_repeating(engine):
    out = engine.generate(
        REPETITIVE,
        {**GREEDY, "max_new_tokens": 8, "presence_penalty": -2.0, "repetition_penalty": 0.5},
    )
    la = engine.tokenizer.encode(" la", add_special_tokens=False)
    assert out["output_ids"] == la * 8


def test_filtered_sampling_is_seeded_and_valid(engine):
    params = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "max_new_tokens": 10,
        "ignore_eos": True,
        "seed": 5,
        "frequency_penalty": 0.3,
    }
    a, b = engine.generate([PROMPT, PROMPT], [params, params])
    assert a["output_ids"] == b["output_ids"]
    assert len(a["output_ids"]) == 10


def test_n_two_returns_two_samples(engine):
    outs = engine.generate(
        PROMPT,
        {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "n": 2, "seed": 3},
        rid="pair",
    )
    assert isinstance(outs, list) and len(outs) == 2
    assert [o["meta_info"]["id"] for o in outs] == ["pair-0", "pair-1"]
    assert all(len(o["output_ids"]) == 12 for o in outs)
    assert outs[0]["output_ids"] != outs[1]["output_ids"]


def test_logprobs_shape_and_greedy_consistency(engine):
    out = engine.generate(
        PROMPT,
        {**GREEDY, "max_new_tokens": 6},
        return_logprob=True,
        top_logprobs_num=4,
        token_ids_logprob=[EOS, 11],
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    n = meta["completion_tokens"]
    assert n == 6
    chosen, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    given = meta["output_token_ids_logprobs"]
    assert len(chosen) == len(tops) == len(given) == n
    assert [t for _, t, _ in chosen] == out["output_ids"]
    for (value, token, text), top, ids in zip(chosen, tops, given):
        assert len(top) == 4
        assert [v for v, _, _ in top] == sorted((v for v, _, _ in top), reverse=True)
        assert top[0][1] == token and top[0][0] == pytest.approx(
            value, abs=1e-5
        )  # greedy took the best
        assert value <= 0.0 and text == engine.tokenizer.decode([token])
        assert [t for _, t, _ in ids] == [EOS, 11]
        assert all(v <= 0.0 for v, _, _ in ids)
    assert meta["input_token_logprobs"] == []  # logprob_start_len defaults to -1: none


async def test_streaming_deltas_concatenate_to_the_whole_text(engine):
    prompts = [
        PROMPT,
        "Écris une phrase en français à propos du café et des crêpes :",
        "用中文写一句关于春天的话：",
    ]
    params = {**GREEDY, "max_new_tokens": 20}
    for prompt in prompts:
        chunks = [c async for c in engine.async_generate(prompt, params, stream=True)]
        whole = engine.generate(prompt, params)
        assert len(chunks) > 1
        assert all("\ufffd" not in c["text"] for c in chunks)
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


INVALID = [
    ("max_new_tokens", {"max_new_tokens": -1}),
    ("min_new_tokens", {"min_new_tokens": -1}),
    ("min_new_tokens", {"min_new_tokens": 5, "max_new_tokens": 4}),
    ("temperature", {"temperature": -0.1}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": 0}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.1}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.5}),
    ("repetition_penalty", {"repetition_penalty": -0.5}),
    ("repetition_penalty", {"repetition_penalty": 2.5}),
    ("n", {"n": 0}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": [49152]}),
    ("logit_bias", {"logit_bias": {"49152": 1.0}}),
    ("logit_bias", {"logit_bias": {"-3": 1.0}}),
    ("json_schema", {"regex": "a+", "json_schema": "{}"}),
    ("regex", {"regex": "(a+"}),  # not a regular expression (the engine says why)
    ("json_schema", {"json_schema": '{"type": "objekt"}'}),
    ("ebnf", {"ebnf": 'start ::= "a"'}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("seed", {"seed": "abc"}),
    ("max_new_tokens", {"max_new_tokens": 1.5}),
]


@pytest.fixture
def scheduler_spy(engine, monkeypatch):
    """Records every request that reaches the scheduler while the test runs."""
    added = []
    original = engine.scheduler.add_request

    def spy(req):
        added.append(req.rid)
        return original(req)

    monkeypatch.setattr(engine.scheduler, "add_request", spy)
    # A request an earlier test abandoned may still be finishing: start from an idle scheduler.
    deadline = time.monotonic() + 30
    while engine.run_in_scheduler(lambda s: bool(s.waiting or s.running)):
        assert time.monotonic() < deadline, "the scheduler never became idle"
        time.sleep(0.05)
    before = engine.run_in_scheduler(lambda s: s.num_generated_tokens)

    def check():
        # run_in_scheduler queues behind anything already sent: a barrier on the inbox.
        state = engine.run_in_scheduler(
            lambda s: (len(s.waiting), len(s.running), s.num_generated_tokens)
        )
        assert added == []
        assert state == (0, 0, before)

    return check


@pytest.mark.parametrize("field,params", INVALID, ids=[f"{f}={p}" for f, p in INVALID])
def test_invalid_sampling_value_rejected_before_the_scheduler(engine, scheduler_spy, field, params):
    with pytest.raises(InvalidParameter) as info:
        engine.generate(PROMPT, params)
    assert isinstance(info.value, ValueError)
    assert info.value.param == field
    assert field in str(info.value)
    scheduler_spy()


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("input_ids", {"input_ids": [1, 2, 49152]}),
        ("input_ids", {"input_ids": [-1]}),
        ("temprature", {"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}),
        (
            "logprob_start_len",
            {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3},
        ),
        ("top_logprobs_num", {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": -1}),
        ("image_data", {"input_ids": [1, 2], "image_data": "http://example.com/cat.png"}),
    ],
)
def test_invalid_request_rejected_before_the_scheduler(engine, scheduler_spy, field, kwargs):
    with pytest.raises(InvalidParameter) as info:
        engine.generate(**kwargs)
    assert (
        info.value.param is None
        or field.startswith(info.value.param)
        or info.value.param.startswith(field)
    )
    scheduler_spy()


def test_batch_with_one_bad_item_sends_nothing(engine, scheduler_spy):
    with pytest.raises(InvalidParameter) as info:
        engine.generate(
            [PROMPT, PROMPT, PROMPT], [{"max_new_tokens": 2}, {"max_new_tokens": 2}, {"top_k": 0}]
        )
    assert info.value.param == "top_k"
    scheduler_spy()


async def test_rid_of_a_live_request_is_refused(engine):
    stream = engine.async_generate(
        PROMPT, {**GREEDY, "max_new_tokens": 200}, stream=True, rid="busy"
    )
    try:
        await anext(stream)
        with pytest.raises(InvalidParameter) as info:
            await anext(engine.async_generate(PROMPT, {"max_new_tokens": 1}, rid="busy"))
        assert info.value.param == "rid"
    finally:
        await stream.aclose()


def test_context_length_overflow_rejected(engine, scheduler_spy):
    ctx = engine.info.context_len
    with pytest.raises(InvalidParameter, match="context length") as info:
        engine.generate(input_ids=[100] * ctx, sampling_params={"max_new_tokens": 1})
    assert info.value.param == "input_ids"
    with pytest.raises(InvalidParameter, match="context length") as info:
        engine.generate(input_ids=[100] * 10, sampling_params={"max_new_tokens": ctx - 9})
    assert info.value.param == "max_new_tokens"
    scheduler_spy()


def test_request_that_does_not_fit_now_waits_then_completes(
    small_engine, monkeypatch, assert_engine_idle
):
    # Each request reserves prompt + max_new_tokens = 9 of the 16 pages: the second must wait.
    # (Different prompts: with a common prefix the second would share the first's pages.)
    sched = small_engine.scheduler
    page = sched.runner.page_size
    prompt = [100 + (i % 50) for i in range(120)]
    other = [160 + (i % 50) for i in range(120)]
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    need = -(-(len(prompt) + 24) // page)
    assert need <= sched.kv.num_pages < 2 * need
    snapshots = []
    original = sched.step

    def recording_step():
        snapshots.append(
            (
                {r.rid for r in sched.waiting},
                {r.rid for r in sched.running} | ({sched.chunked.rid} if sched.chunked else set()),
            )
        )
        return original()

    monkeypatch.setattr(sched, "step", recording_step)
    a, b = small_engine.generate(
        input_ids=[prompt, other], sampling_params=params, rid=["first", "second"]
    )
    length_24 = {"type": "length", "length": 24}
    assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"] == length_24
    assert any("second" in waiting and "first" in admitted for waiting, admitted in snapshots)
    assert not any({"first", "second"} <= admitted for _, admitted in snapshots), (
        "both held pages at once"
    )
    assert_engine_idle(small_engine)


def test_more_requests_than_batch_slots_queue_and_complete(
    small_engine, monkeypatch, assert_engine_idle
):
    slots = small_engine.args.max_running_requests
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] * 4 for i in range(slots + 2)]
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    seen_running = []
    original = small_engine.scheduler.step

    def recording_step():
        seen_running.append(len(small_engine.scheduler.running))
        return original()

    monkeypatch.setattr(small_engine.scheduler, "step", recording_step)
    together = small_engine.generate(input_ids=prompts, sampling_params=params)
    monkeypatch.undo()
    assert max(seen_running) == slots
    alone = [small_engine.generate(input_ids=p, sampling_params=params) for p in prompts[-2:]]
    assert [o["output_ids"] for o in together[-2:]] == [o["output_ids"] for o in alone]
    assert all(len(o["output_ids"]) == 6 for o in together)
    assert_engine_idle(small_engine)


def test_request_that_can_never_fit_gets_a_clear_error(small_engine, assert_engine_idle):
    pool = small_engine.scheduler.runner.max_total_tokens
    # Decided at the edge, like every other bad value: a 400 naming the field.
    with pytest.raises(InvalidParameter) as info:
        small_engine.generate(input_ids=[100] * 50, sampling_params={"max_new_tokens": pool})
    assert info.value.param == "max_new_tokens"
    message = str(info.value)
    assert str(pool) in message and "max_new_tokens" in message
    assert_engine_idle(small_engine)
    # The engine still serves afterwards.
    ok = small_engine.generate(input_ids=[100] * 50, sampling_params={"max_new_tokens": 2})
    assert len(ok["output_ids"]) == 2
