"""Nothing leaks: after requests that finish, stop, get aborted or get refused, every KV page
is free again and no queue or per-rid state is left behind."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from cadence.errors import InvalidParameter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = "The capital of France is"
EOS = 2
# Far longer than any test waits: a request with these parameters only ends early if aborted.
ENDLESS = {"temperature": 0.0, "max_new_tokens": 500, "ignore_eos": True}


def where(engine, rid: str) -> tuple[str | None, int]:
    """(queue holding rid or None, tokens it has generated), read on the scheduler thread."""

    def read(s):
        for name, reqs in (
            ("waiting", list(s.waiting)),
            ("running", s.running),
            ("chunked", [s.chunked] if s.chunked else []),
        ):
            for r in reqs:
                if r.rid == rid:
                    return name, len(r.output_ids)
        return None, 0

    return engine.run_in_scheduler(read)


async def wait_for(
    engine, task: asyncio.Task, rid: str, queue: str, min_tokens: int = 0, timeout: float = 30.0
) -> None:
    """Waits until `rid` sits in `queue` with at least `min_tokens` generated."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if task.done():
            task.result()  # raises what the request raised
            raise AssertionError(f"{rid} ended before reaching {queue}")
        state = await asyncio.to_thread(where, engine, rid)
        if state[0] == queue and state[1] >= min_tokens:
            return
        assert asyncio.get_running_loop().time() < deadline, f"{rid} never reached {queue}: {state}"
        await asyncio.sleep(0.01)


async def final(engine, *args, **kwargs) -> dict | list:
    result = None
    async for result in engine.async_generate(*args, **kwargs):  # noqa: B007 (the last one)
        pass
    return result


async def test_no_leak_after_finished_stopped_aborted_and_refused(engine, assert_engine_idle):
    usage = engine.run_in_scheduler(lambda s: s.kv.check())
    assert usage.num_free + usage.num_evictable == usage.num_pages

    async def finished():
        outs = await final(
            engine, [PROMPT, "Once upon a time"], {"temperature": 0.0, "max_new_tokens": 6}
        )
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length", "length"]

    async def stopped_by_string():
        out = await final(engine, PROMPT, {"temperature": 0.0, "max_new_tokens": 30, "stop": "."})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}

    async def stopped_by_eos():
        out = await final(
            engine, PROMPT, {"temperature": 0.0, "max_new_tokens": 30, "logit_bias": {EOS: 50.0}}
        )
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}

    async def stream_left_by_break():
        seen = 0
        async for chunk in engine.async_generate(PROMPT, ENDLESS, stream=True, rid="left-by-break"):
            seen += len(chunk["output_ids"])
            if seen >= 2:
                break  # the generator is dropped here; its cleanup aborts the request
        assert seen >= 2

    async def stream_closed():
        gen = engine.async_generate(PROMPT, ENDLESS, stream=True, rid="closed")
        async with contextlib.aclosing(gen):
            chunk = await anext(gen)
            assert chunk["output_ids"]

    async def aborted_by_rid():
        task = asyncio.create_task(final(engine, PROMPT, ENDLESS, rid="abort-me"))
        await wait_for(engine, task, "abort-me", "running", min_tokens=1)
        engine.abort("abort-me")
        out = await asyncio.wait_for(task, 30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < out["meta_info"]["completion_tokens"] < ENDLESS["max_new_tokens"]

    async def parallel_samples_aborted_by_parent_rid():
        task = asyncio.create_task(
            final(engine, PROMPT, {**ENDLESS, "n": 2, "temperature": 1.0}, rid="pair")
        )
        await wait_for(engine, task, "pair-1", "running", min_tokens=1)
        engine.abort("pair")
        outs = await asyncio.wait_for(task, 30)
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]

    async def refused():
        with pytest.raises(InvalidParameter):
            await final(engine, PROMPT, {"top_p": 0.0})
        with pytest.raises(InvalidParameter):
            await final(engine, PROMPT, {"max_new_tokens": engine.info.context_len})

    await asyncio.gather(
        finished(),
        stopped_by_string(),
        stopped_by_eos(),
        stream_left_by_break(),
        stream_closed(),
        aborted_by_rid(),
        parallel_samples_aborted_by_parent_rid(),
        refused(),
    )
    assert_engine_idle(engine)


async def test_no_leak_after_aborts_while_waiting_and_during_chunked_prefill(
    small_engine, assert_engine_idle
):
    engine = small_engine
    pages = engine.run_in_scheduler(lambda s: s.kv.num_pages)
    page_size = engine.scheduler.runner.page_size
    # "hog" reserves 14 of the 16 pages; "waiter" needs 5 more, so it queues behind it.
    hog = asyncio.create_task(
        final(
            engine,
            input_ids=[100] * 120,
            sampling_params={**ENDLESS, "max_new_tokens": 100},
            rid="hog",
        )
    )
    await wait_for(engine, hog, "hog", "running", min_tokens=1)
    waiter = asyncio.create_task(
        final(
            engine,
            input_ids=[200] * 50,
            sampling_params={**ENDLESS, "max_new_tokens": 24},
            rid="waiter",
        )
    )
    await wait_for(engine, waiter, "waiter", "waiting")
    engine.abort("waiter")
    out = await asyncio.wait_for(waiter, 30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["output_ids"] == []
    free = engine.run_in_scheduler(lambda s: s.kv.usage().num_free)
    assert free <= pages - 120 // page_size  # the hog still holds its pages
    engine.abort(abort_all=True)
    out = await asyncio.wait_for(hog, 30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert_engine_idle(engine)

    # A 200-token prompt takes 13 chunked prefill steps; abort it in the middle of them.
    prompt = [300 + i % 40 for i in range(200)]
    chunky = asyncio.create_task(
        final(
            engine,
            input_ids=prompt,
            sampling_params={**ENDLESS, "max_new_tokens": 40},
            rid="chunky",
        )
    )
    await wait_for(engine, chunky, "chunky", "chunked")
    engine.abort("chunky")
    out = await asyncio.wait_for(chunky, 30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["output_ids"] == []
    assert_engine_idle(engine)

    # Refused outright (can never fit the pool): nothing is taken either.
    with pytest.raises(InvalidParameter):
        await final(engine, input_ids=[100] * 20, sampling_params={"max_new_tokens": 1000})
    assert_engine_idle(engine)

    # And the pool is whole: a request needing every page runs.
    total = engine.scheduler.runner.max_total_tokens
    out = await final(
        engine, input_ids=[100] * (total - 8), sampling_params={**ENDLESS, "max_new_tokens": 8}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert_engine_idle(engine)
