"""The radix prefix cache with the real model: greedy outputs are the same with the cache on
and off, cached_tokens says what was reused, n > 1 and batches share their prompt through the
tree, sessions reuse every earlier turn and unpin on close, and nothing leaks."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.conftest import engine_state, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
SYSTEM = (
    "You are a meticulous assistant for a botanical garden. You answer questions about "
    "plants, their care, their history and the garden's opening hours, in one short sentence. "
)


def chatml(turns: list[tuple[str, str]], open_assistant: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if open_assistant else "")


@pytest.fixture(scope="module")
def nocache():
    from cadence import Engine

    e = Engine(model_path=None, dtype="float32", disable_radix_cache=True)
    yield e
    e.shutdown()


@pytest.fixture
def cache(engine):
    """The shared engine with an empty prefix cache."""
    wait_idle(engine)
    assert engine.flush_cache().success
    return engine


def cached(out) -> int:
    return out["meta_info"]["cached_tokens"]


def page_size(engine) -> int:
    return engine.run_in_scheduler(lambda s: s.kv.page_size)


def test_the_same_prompt_twice_reuses_it_and_answers_the_same(cache, nocache):
    prompt = SYSTEM + "When does the garden open on Sundays?"
    first, second = cache.generate(prompt, GREEDY), cache.generate(prompt, GREEDY)
    reference = nocache.generate(prompt, GREEDY)
    assert first["output_ids"] == second["output_ids"] == reference["output_ids"]
    num = first["meta_info"]["prompt_tokens"]
    page = page_size(cache)
    assert cached(first) == 0
    assert cached(second) == (num - 1) // page * page > 0  # all but a partial last page
    assert cached(reference) == 0


def test_prefixes_that_end_mid_page_answer_the_same(cache, nocache):
    page = page_size(cache)
    common = [400 + (i * 7) % 300 for i in range(3 * page + 5)]  # ends inside page 4
    cache.generate(input_ids=common, sampling_params={"max_new_tokens": 0})
    prompts = [common + [900 + k] * (4 + k) for k in range(3)]
    outs = [cache.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
    refs = nocache.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in refs]
    for out in outs:  # the whole pages of the shared prefix, never the partial one
        assert cached(out) == 3 * page


def test_a_chat_whose_second_turn_extends_the_first(cache, nocache):
    turn1 = [("system", SYSTEM), ("user", "Name one flower that blooms in winter.")]
    first = cache.generate(chatml(turn1), GREEDY)
    turn2 = [*turn1, ("assistant", first["text"]), ("user", "And one that blooms in spring?")]
    second = cache.generate(chatml(turn2), GREEDY)
    reference = nocache.generate(chatml(turn2), GREEDY)
    assert second["output_ids"] == reference["output_ids"]
    page = page_size(cache)
    # Everything turn 1 computed (its prompt and answer, whole pages) is reused.
    assert cached(second) >= (first["meta_info"]["prompt_tokens"] - 1) // page * page


def test_a_batch_with_a_common_prefix_prefills_it_once(cache, nocache):
    prompts = [SYSTEM * 3 + f"Question {i}: name a plant." for i in range(4)]
    outs = cache.generate(prompts, GREEDY)
    refs = nocache.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in refs]
    shared = [cached(o) for o in outs]
    # Admitted together, one computes the common prefix and the others take it from the tree.
    assert sorted(shared)[0] == 0 and all(n >= 3 * 16 for n in sorted(shared)[1:]), shared


def test_n_samples_share_the_prompt_and_match_the_uncached_samples(cache, nocache):
    prompt = SYSTEM + "Invent a name for a new rose."
    params = {"temperature": 0.8, "max_new_tokens": 10, "n": 4, "seed": 7, "ignore_eos": True}
    outs = cache.generate(prompt, params)
    refs = nocache.generate(prompt, params)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in refs]
    assert sum(1 for o in outs if cached(o) > 0) == 3  # one prefills, three reuse
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # the seeds still differ per sample


def test_a_five_turn_session_reuses_its_history_and_unpins_on_close(cache):
    sid = cache.open_session(capacity_of_str_len=4096)
    page = page_size(cache)
    rid, history = None, 0
    for turn in range(5):
        text = chatml([("user", f"Turn {turn}: name a fruit.")])
        out = cache.generate(
            text,
            {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            rid=f"{sid}-{turn}",
            session_params={"id": sid, "rid": rid},
        )
        meta = out["meta_info"]
        if turn:
            # The whole history (earlier prompts and answers) came from the cache, except
            # the partial last page and the last answer token (whose KV nothing computed).
            assert cached(out) == (history - 1) // page * page
            assert meta["prompt_tokens"] > history
        history = meta["prompt_tokens"] + meta["completion_tokens"]
        rid = f"{sid}-{turn}"
    pinned = engine_state(cache)["in_use_pages"]
    assert pinned >= (history - 1) // page  # the session pins its KV while open
    # A flush keeps what an open session pins.
    assert cache.flush_cache().success
    assert engine_state(cache)["in_use_pages"] == pinned
    assert cache.close_session(sid)
    state = engine_state(cache)
    assert state["in_use_pages"] == 0 and state["free_pages"] == state["num_pages"]
    assert not cache.close_session(sid)  # closing twice is harmless


def test_session_branching_and_bad_session_params(cache):
    sid = cache.open_session()
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    a = cache.generate("Hello there.", params, rid="a", session_params={"id": sid})
    b = cache.generate(" More.", params, rid="b", session_params={"id": sid, "rid": "a"})
    assert b["meta_info"]["prompt_tokens"] > a["meta_info"]["prompt_tokens"]
    # offset keeps only the first tokens of the history; replace drops b's branch.
    c = cache.generate(
        " Other.", params, rid="c", session_params={"id": sid, "rid": "a", "offset": 2}
    )
    assert c["meta_info"]["prompt_tokens"] == 2 + b["meta_info"]["prompt_tokens"] - (
        a["meta_info"]["prompt_tokens"] + 4
    )
    cache.generate(" X.", params, rid="d", session_params={"id": sid, "rid": "a", "replace": True})
    for bad, why in (
        ({"id": "no-such-session"}, "not open"),
        ({"id": sid, "rid": "b"}, "is not a request of this session"),  # replaced away
        ({"id": sid, "rid": "nope"}, "is not a request of this session"),
    ):
        with pytest.raises(Exception, match=why) as info:
            cache.generate("hi", params, session_params=bad)
        assert getattr(info.value, "status", 400) == 400
    with pytest.raises(ValueError, match="already open"):
        cache.open_session(session_id=sid)
    assert cache.close_session(sid)
    assert engine_state(cache)["in_use_pages"] == 0


async def test_no_leak_after_finished_aborted_and_failed_requests_with_the_cache(
    small_engine, monkeypatch, assert_engine_idle
):
    """Requests sharing prefixes that finish, fail, or are aborted while waiting, prefilling
    and decoding: afterwards no page is in use, free + evictable is the pool, and a flush
    frees everything."""
    engine = small_engine
    sched = engine.scheduler
    prefix = [300 + i % 37 for i in range(40)]
    short = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    endless = {"temperature": 0.0, "max_new_tokens": 60, "ignore_eos": True}

    check = sched.stops.check

    def failing_check(req, token):  # one request fails while decoding, the others go on
        if req.rid == "boom" and len(req.output_ids) == 2:
            raise RuntimeError("injected failure")
        if req.rid.startswith("ab"):
            # At least 30 ms a token: the aborted requests are still running a second in
            # however fast the machine decodes (60 tokens take 1.8 s or more).
            time.sleep(0.03)
        return check(req, token)

    monkeypatch.setattr(sched.stops, "check", failing_check)

    async def run(rid, ids, params):
        out = None
        async for out in engine.async_generate(input_ids=ids, sampling_params=params, rid=rid):  # noqa: B007
            pass
        return out

    done = await asyncio.gather(*(run(f"ok{i}", prefix + [i + 5], short) for i in range(3)))
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in done)
    with pytest.raises(Exception, match="injected failure"):
        await run("boom", prefix + [7, 8, 9], short)
    tasks = [
        asyncio.create_task(run(f"ab{i}", prefix + [50 + i] * (8 + 16 * i), endless))
        for i in range(4)
    ]
    await asyncio.sleep(1.0)  # some decode, one prefills in chunks, others wait for pages
    engine.abort(abort_all=True)
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert_engine_idle(engine)
    state = engine_state(engine)
    assert state["in_use_pages"] == 0 and state["free_pages"] == state["num_pages"]
    assert engine.flush_cache().success
    assert engine.run_in_scheduler(lambda s: s.kv.usage().num_free) == state["num_pages"]
