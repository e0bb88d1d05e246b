"""The bounded buffer between a result iterator and a gRPC stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cadence.grpc.streams import BacklogWatch, buffered


class Source:
    """An async generator of `n` items, one per `gap` seconds, that records being closed."""

    def __init__(self, n: int, gap: float = 0.0, fail_at: int | None = None):
        self.n, self.gap, self.fail_at = n, gap, fail_at
        self.closed = False

    async def gen(self):
        try:
            for i in range(self.n):
                await asyncio.sleep(self.gap)
                if i == self.fail_at:
                    raise ValueError("boom")
                yield i
        finally:
            self.closed = True


async def test_a_reader_keeping_up_gets_every_item_in_order():
    src = Source(20)
    got = [x async for batch in buffered(src.gen(), limit=4) for x in batch]
    assert got == list(range(20)) and src.closed


async def test_a_slow_reader_gets_batches_not_an_error():
    src = Source(30)
    batches = []
    async for batch in buffered(src.gen(), limit=64):
        batches.append(batch)
        await asyncio.sleep(0.01)  # the producer runs ahead meanwhile
    assert [x for b in batches for x in b] == list(range(30))
    assert len(batches) < 30


async def test_a_reader_that_stops_reading_is_ended_with_resource_exhausted_and_the_source_closed():
    src = Source(1000)
    ended = []

    async def on_overflow(error):  # the servicer aborts the call; here: end the stuck reader
        ended.append(error)
        reader.cancel()

    async def read():
        async for _ in buffered(src.gen(), limit=8, on_overflow=on_overflow):
            await asyncio.sleep(3600)  # stuck in a send that never completes

    reader = asyncio.create_task(read())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(reader, 5)
    assert ended[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--grpc-stream-buffer" in str(ended[0])
    assert src.closed


async def test_leaving_early_closes_the_source():
    src = Source(1000, gap=0.001)
    async for _ in buffered(src.gen(), limit=8):
        break
    await asyncio.sleep(0.01)
    assert src.closed


async def test_cancelling_the_reader_closes_the_source():
    src = Source(1000, gap=0.01)

    async def read():
        async for _ in buffered(src.gen(), limit=8):
            pass

    task = asyncio.create_task(read())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert src.closed


async def test_a_failing_source_raises_its_error():
    src = Source(10, gap=0.001, fail_at=3)
    got = []
    with pytest.raises(ValueError, match="boom"):
        async for batch in buffered(src.gen(), limit=8):
            got.extend(batch)
    assert got == [0, 1, 2] and src.closed


async def test_backlog_watch_ends_only_the_stream_that_falls_behind():
    held = {"slow": 0, "fast": 0}
    ended = []

    async def end(name, error):
        ended.append((name, error))

    watch = BacklogWatch(limit=10, interval=0.01)
    keys = {
        name: watch.watch(lambda name=name: held[name], lambda e, name=name: end(name, e))
        for name in held
    }
    held["slow"], held["fast"] = 11, 10  # fast is at the limit, not beyond
    await asyncio.sleep(0.05)
    assert [name for name, _ in ended] == ["slow"]
    error = ended[0][1]
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "11 tokens" in str(error)
    assert len(watch) == 1  # an overflowed stream is no longer watched
    watch.unwatch(keys["fast"])
    await asyncio.sleep(0.05)
    assert watch._task is None  # the checking task ends with the last stream


async def test_backlog_watch_swallows_the_abort_that_ends_a_call():
    calls = []

    async def abort(error):
        calls.append(error)
        raise grpc.aio.AbortError()

    watch = BacklogWatch(limit=0, interval=0.01)
    watch.watch(lambda: 1, abort)
    await asyncio.sleep(0.05)
    assert len(calls) == 1 and len(watch) == 0
