"""The memory of a busy step, taken when a model runner starts (`ModelRunner`'s committed
pool): throwaway prefill steps of twice, then once, the largest size the scheduler asks for."""

from __future__ import annotations

import logging
import time

from cadence.model_executor.runner import BatchItem, ScheduleBatch

logger = logging.getLogger("cadence.model_executor.model_runner")

# Inputs of the throwaway steps are at most this long: their attention stays cheap, and
# what they allocate is the linear layers' activations, which grow with a step's tokens.
ITEM_TOKENS = 512
WARM_LAYERS = 2  # of each stage, that the throwaway steps run


def commit_step_memory(runner) -> None:
    """Runs two throwaway steps on zero ids and free pages: a prefill of twice the largest
    step the scheduler asks for (--chunked-prefill-size tokens, within half the pool; its
    inputs twice over, on the same pages), then those inputs continued by as many tokens,
    attending to what the first wrote, as a long prompt's later chunks do (their attention
    over a prefix takes more). What their activations take, the process keeps for the
    steps after them (a host heap holds freed memory for reuse, a device allocator caches
    it), so the memory busy steps would add is taken at start, like the pool's; vLLM's
    profile run does the same.

    Twice the largest step: a heap holds a step's blocks wherever they fit among what it
    already holds, and where that is differs from run to run (Python's hash seed alone
    changes it), so a step shaped unlike the throwaway ones may not fit in the holes they
    left and grow the heap. The doubled step leaves holes twice the size. Measured on the
    memory soak of tests/e2e/test_kv_memory.py, five servers each: with it, the server grew
    0.0-1.7% under load, holding 4% more when fresh; with the largest step once, 2.9-4.3%.

    Only the first two layers of each stage run: a layer's activations are freed before the
    next starts, so two layers reach the same peak as all of them, at a fraction of the time
    (0.4 s on two cores, where the full model took 13 s of a server's start). Two, not one:
    the second runs with the first one's output held, as every later layer does, and leaves
    the heap laid out as the steps after it will find it (on the same soak, with the largest
    step once: 0.1-3.4% over five servers with two layers, 4.2-6.7% over three with one).
    Every rank cuts the same way, so the ranks' collectives still pair up."""
    page = runner.page_size
    budget = runner.args.prefill_token_budget(runner.context_len)
    num_tokens = min(budget, runner.max_total_tokens // 2) // page * page
    per_item = min(ITEM_TOKENS, runner.context_len // 2) // page * page
    if num_tokens < page or per_item < page:
        return  # a pool or a context too small to matter
    first, then, num_pages = [], [], 0
    for start in range(0, num_tokens, per_item):  # whole pages, so they fit in the pool
        n = min(per_item, num_tokens - start)
        pages = list(range(num_pages, num_pages + 2 * runner._pages_for(n)))
        num_pages += len(pages)
        first.append(BatchItem(rid="", uid=-1, token_ids=[0] * n, start=0, pages=pages))
        then.append(BatchItem(rid="", uid=-1, token_ids=[0] * n, start=n, pages=pages))
    started = time.perf_counter()
    # First one page through every layer: what a layer sets up at its first call (packed
    # weights, kernel scratch) is set up for all of them.
    warm = BatchItem(rid="", uid=-1, token_ids=[0] * page, start=0, pages=[0])
    runner.run(ScheduleBatch(is_decode=False, items=[warm], new_pages=[]))
    layers = runner.model.layers
    runner.model.layers = layers[:WARM_LAYERS]
    try:
        for items in (first * 2, then):
            runner.run(ScheduleBatch(is_decode=False, items=items, new_pages=[]))
    finally:
        runner.model.layers = layers
    logger.info(
        "a step's memory taken: steps of %d and %d tokens in %.1f s",
        2 * num_tokens,
        num_tokens,
        time.perf_counter() - started,
    )
