"""A large embedding request does not hold the server: its inputs run in short steps taken in
turn with other requests', so a one-input request sent while it runs is answered within a
second (all-MiniLM-L6-v2 on `embedding_server`, through the openai SDK).

Before inputs were taken in turn, the one-input request waited for every input queued ahead
of it: on a busy 2-core machine (load 10), 18.8 s behind the 32 inputs of 512 tokens sent
here, against 0.4 s now.
"""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest
from e2e_server import is_idle, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_INPUTS = 32  # of --max-embedding-batch 64
INPUT_TOKENS = 512  # MiniLM's whole context


async def embed_behind_a_large_request(url: str) -> dict:
    rng = random.Random(3)
    inputs = [[rng.randrange(1000, 29000) for _ in range(INPUT_TOKENS)] for _ in range(NUM_INPUTS)]
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=240
    ) as client:
        model = (await client.models.list()).data[0].id
        # What one full-length input takes alone right now (a step and the round trip): the
        # machine's pace, which the wait below is judged against.
        alone = []
        for ids in inputs[:3]:
            sent = time.monotonic()
            await client.embeddings.create(model=model, input=[ids])
            alone.append(time.monotonic() - sent)
        large = asyncio.create_task(client.embeddings.create(model=model, input=inputs))
        started = time.monotonic()
        while not large.done() and time.monotonic() - started < 0.5:
            await asyncio.sleep(0.05)  # its first steps run
        sent = time.monotonic()
        small = await client.embeddings.create(model=model, input="one small input")
        waited = time.monotonic() - sent
        large_was_running = not large.done()
        result = await large
    assert len(small.data) == 1 and len(small.data[0].embedding) == 384
    assert len(result.data) == NUM_INPUTS
    return {
        "one_input_s": sorted(alone)[1],
        "waited_s": waited,
        "large_s": time.monotonic() - started,
        "large_was_running": large_was_running,
    }


def test_a_one_input_request_is_answered_within_a_second_behind_a_large_one(embedding_server):
    got = asyncio.run(embed_behind_a_large_request(embedding_server.url))
    print(
        f"\none input behind {NUM_INPUTS} x {INPUT_TOKENS} tokens: answered in "
        f"{got['waited_s']:.2f} s (one full input alone: {got['one_input_s']:.2f} s; "
        f"the large request: {got['large_s']:.1f} s)"
    )
    # At most the step in flight (one input, the least a step takes) and its own short step.
    # On an idle 2-core machine one input takes ~0.15 s, so this is the 1 s of the issue; a
    # loaded runner slows both alike. Before, it waited for every input queued ahead of it.
    assert got["waited_s"] <= max(1.0, 3 * got["one_input_s"])
    assert got["large_was_running"], "the large request ended before the small one was sent"
    assert wait_until(lambda: is_idle(embedding_server.load()), timeout=10)
