"""Engines on the real default model (SmolLM2-135M-Instruct), loaded once per session.

`engine` is the plain float32 engine most tests share (the GGUF's quantized weights served
as they are; `dequantized_engine` widens them). `small_engine` has a 16-token
prefill chunk and a 256-token KV pool (16 pages), so chunked prefill, waiting for memory
and refusing what can never fit happen with short prompts.
"""

from __future__ import annotations

import time

import pytest

SMALL_POOL_TOKENS = 256
SMALL_CHUNK = 16


def _load(**kwargs):
    from cadence import Engine

    return Engine(model_path=None, dtype="float32", **kwargs)


@pytest.fixture(scope="session")
def engine():
    e = _load()
    yield e
    e.shutdown()


@pytest.fixture(scope="session")
def dequantized_engine():
    """The default GGUF widened to float32 at load (--dequantize): the reference the quantized
    default engine is compared with."""
    e = _load(dequantize=True, max_total_tokens=2048)
    yield e
    e.shutdown()


@pytest.fixture(scope="session")
def small_engine():
    e = _load(
        chunked_prefill_size=SMALL_CHUNK, max_total_tokens=SMALL_POOL_TOKENS, max_running_requests=4
    )
    yield e
    e.shutdown()


def engine_state(engine) -> dict:
    """Everything a finished request must have given back, read on the scheduler thread."""

    def read(s):
        usage = s.kv.check()  # the KV books balance, recounted from the holders' side
        return {
            # Pages no live request holds: free, or kept only by the prefix cache.
            "free_pages": usage.num_free + usage.num_evictable,
            "in_use_pages": usage.num_in_use,
            "num_pages": usage.num_pages,
            "waiting": len(s.waiting),
            "running": len(s.running),
            "chunked": s.chunked is not None,
            "detokenizer_states": len(engine._worker.detokenizer.states),
            "decode_state_bytes": s.runner.attn.decode_state_bytes(),  # K/V copies kept between decode steps
        }

    state = engine.run_in_scheduler(read)
    state["front_states"] = len(engine.client.tm.states)
    return state


def idle_state(state: dict) -> dict:
    """What `state` must read once nothing is live: every page free, no queues."""
    return {
        **state,
        "free_pages": state["num_pages"],
        "in_use_pages": 0,
        "waiting": 0,
        "running": 0,
        "chunked": False,
        "detokenizer_states": 0,
        "front_states": 0,
        "decode_state_bytes": 0,
    }


def wait_idle(engine, timeout: float = 10.0) -> dict:
    """Polls until the engine holds nothing (aborts are asynchronous); returns the last state."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(engine)
        if state == idle_state(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


@pytest.fixture
def assert_engine_idle():
    """Asserts that an engine is (or soon becomes) back to an empty KV pool and no live requests."""

    def check(engine, timeout: float = 10.0) -> None:
        state = wait_idle(engine, timeout)
        assert state == idle_state(state)

    return check
