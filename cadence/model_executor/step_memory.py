"""The memory of a busy step, taken when a model runner starts (`ModelRunner`'s committed
pool): two throwaway prefill steps of the largest size the scheduler asks for."""

from __future__ import annotations

import logging
import time

from cadence.model_executor.runner import BatchItem, ScheduleBatch

logger = logging.getLogger("cadence.model_executor.model_runner")

# Inputs of the throwaway steps are at most this long: their attention stays cheap, and
# what they allocate is the linear layers' activations, which grow with a step's tokens.
ITEM_TOKENS = 512


def commit_step_memory(runner) -> None:
    """Runs two throwaway steps of the largest size the scheduler asks for, on zero ids
    and free pages: a prefill of --chunked-prefill-size tokens (within half the pool),
    then the same inputs continued by as many tokens, attending to what the first wrote,
    as a long prompt's later chunks do (their attention over a prefix takes more). What
    their activations take, the process keeps for the steps after them (a host heap holds
    freed memory for reuse, a device allocator caches it), so the memory busy steps would
    add is taken at start, like the pool's; vLLM's profile run does the same. Measured,
    the continuation keeps a server's growth under load at ~2% where the first step
    alone left ~5%.

    Only the first layer of each stage runs: a layer's activations are freed before the
    next starts, so one layer reaches the same peak as all of them, at a fraction of the
    time: 0.3 s where the full model took 13 s of a 2-core server's start. Measured over
    four soaks each, what the scheduler then grew under load (18-82 MiB) is within the
    noise of the full model's (38-66 MiB). Every rank cuts the same way, so the ranks'
    collectives still pair up."""
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
    runner.model.layers = layers[:1]
    try:
        for items in (first, then):
            runner.run(ScheduleBatch(is_decode=False, items=items, new_pages=[]))
    finally:
        runner.model.layers = layers
    logger.info(
        "a step's memory taken: 2 steps of %d tokens in %.1f s",
        num_tokens,
        time.perf_counter() - started,
    )
