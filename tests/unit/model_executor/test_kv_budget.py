"""How the runner sizes the KV pool when --max-total-tokens does not: a share of the memory
available now (--kv-cache-memory-fraction), or SGLang's --mem-fraction-static, where the
weights and the pool together take a share of what was available before the weights loaded.
The platform's memory is a stand-in that reports what a test sets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cadence.model_executor.model_runner import ModelRunner
from cadence.server_args import ServerArgs

GIB = 2**30
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 4
PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # K and V, float32


class Memory:
    def __init__(self, available: int):
        self.available = available

    def available_memory_bytes(self) -> int:
        return self.available


def runner(args: ServerArgs, at_start: int, now: int) -> ModelRunner:
    """A runner with only what sizing reads: the model's shape, the platform's memory (what
    was available before the weights loaded, and now), no ranks."""
    r = ModelRunner.__new__(ModelRunner)
    r.args, r.groups, r.page_size, r.kv_dtype = args, None, args.page_size, torch.float32
    r.model = SimpleNamespace(layers=[None] * LAYERS, dims=SimpleNamespace(num_kv_heads=KV_HEADS))
    r.config = SimpleNamespace(head_dim=HEAD_DIM)
    r.platform = Memory(now)
    r._available_at_start = at_start if args.mem_fraction_static is not None else None
    return r


def tokens_for(num_bytes: float, page: int = 16) -> int:
    return int(num_bytes) // PER_TOKEN // page * page


def test_the_default_share_is_of_the_memory_available_now():
    r = runner(ServerArgs(kv_cache_memory_fraction=0.25), at_start=8 * GIB, now=6 * GIB)
    assert r._kv_budget_tokens() == tokens_for(0.25 * 6 * GIB)


def test_mem_fraction_static_shares_the_memory_of_the_start_between_weights_and_pool():
    """8 GiB available at start, the weights took 2: at 0.5 the pool gets 4 - 2 = 2 GiB."""
    r = runner(ServerArgs(mem_fraction_static=0.5), at_start=8 * GIB, now=6 * GIB)
    assert r._kv_budget_tokens() == tokens_for(2 * GIB)
    r = runner(ServerArgs(mem_fraction_static=0.9), at_start=8 * GIB, now=6 * GIB)
    assert r._kv_budget_tokens() == tokens_for(6 * GIB - 0.1 * 8 * GIB)


def test_max_total_tokens_caps_what_the_fraction_gives():
    args = ServerArgs(mem_fraction_static=0.5, max_total_tokens=1000)
    assert runner(args, at_start=8 * GIB, now=6 * GIB)._kv_budget_tokens() == 992  # whole pages
    small = ServerArgs(mem_fraction_static=0.5, max_total_tokens=10**9)
    assert runner(small, 8 * GIB, 6 * GIB)._kv_budget_tokens() == tokens_for(2 * GIB)
    alone = ServerArgs(max_total_tokens=1000)  # without a fraction: exactly the pool asked for
    assert runner(alone, 8 * GIB, 1)._kv_budget_tokens() == 992


def test_a_fraction_the_weights_already_spent_is_a_clear_start_up_error():
    r = runner(ServerArgs(mem_fraction_static=0.3), at_start=8 * GIB, now=5 * GIB)
    with pytest.raises(ValueError) as e:
        r._kv_budget_tokens()
    assert "--mem-fraction-static 0.3" in str(e.value) and "--max-total-tokens" in str(e.value)


def test_the_flag_is_checked_and_its_fraction_is_a_share():
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match="mem_fraction_static"):
            ServerArgs(mem_fraction_static=bad)
