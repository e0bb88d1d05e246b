"""The CPU engine both ways: through Cadence's CPU kernels (the default where they build)
and through torch's own ops (what a machine without a C++ compiler, or
CADENCE_CPU_KERNELS=0, runs). Greedy float32 output is the same token for token, and the
torch path leaves nothing behind either."""

from __future__ import annotations

import pytest

import cadence.kernels

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY_32 = {"temperature": 0.0, "max_new_tokens": 32, "min_new_tokens": 32}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:\n1.",
]


@pytest.fixture(scope="module")
def torch_ops_engine():
    from cadence import Engine

    patch = pytest.MonkeyPatch()
    patch.setattr(cadence.kernels, "cpu_kernels_available", lambda: False)
    try:
        e = Engine(model_path=None, dtype="float32")
    finally:
        patch.undo()
    yield e
    e.shutdown()


def kinds(engine) -> tuple[str, str]:
    return engine.run_in_scheduler(
        lambda s: (type(s.runner.attn).__name__, type(s.runner.model.ops).__name__)
    )


def test_both_paths_generate_the_same_greedy_tokens(engine, torch_ops_engine, assert_engine_idle):
    if not cadence.kernels.cpu_kernels_available():
        pytest.skip(
            "Cadence's CPU kernels could not be built on this machine: only the torch path runs"
        )
    assert kinds(engine) == ("CpuPagedBackend", "CpuFusedOps")
    assert kinds(torch_ops_engine) == ("TorchNativeBackend", "LayerOps")
    # A batch of prompts of different lengths, so decode attends over padded page tables.
    fused = engine.generate(PROMPTS, GREEDY_32)
    plain = torch_ops_engine.generate(PROMPTS, GREEDY_32)
    for a, b in zip(fused, plain):
        assert a["output_ids"] == b["output_ids"], (a["text"], b["text"])
    assert_engine_idle(torch_ops_engine)
    assert_engine_idle(engine)


def poison_next_pages(engine, count: int = 256) -> int:
    """Fill the pages the allocator hands out next with NaN, in every layer (stale memory)."""
    import torch

    def fill(s):
        pages = torch.tensor(s.runner.kv_allocator.free_pages[-count:], dtype=torch.int64)
        for buf in s.runner.kv_pool.kv_buffer:
            buf.index_fill_(2, pages, float("nan"))
        return len(pages)

    return engine.run_in_scheduler(fill)


@pytest.mark.parametrize("which", ["cpu-kernels", "torch-ops"])
def test_stale_nan_in_fresh_pages_changes_nothing(
    which, engine, torch_ops_engine, assert_engine_idle
):
    """The torch path reads whole pages and has the runner zero each fresh one; the kernel
    path reads only each sequence's own slots and skips the zeroing. Either way, NaN left
    in reused pages must not reach the output."""
    e = engine if which == "cpu-kernels" else torch_ops_engine
    if which == "cpu-kernels" and not cadence.kernels.cpu_kernels_available():
        pytest.skip("Cadence's CPU kernels could not be built on this machine")
    clean = [r["output_ids"] for r in e.generate(PROMPTS, GREEDY_32)]
    assert poison_next_pages(e) >= 64
    poisoned = [r["output_ids"] for r in e.generate(PROMPTS, GREEDY_32)]
    assert poisoned == clean
    assert_engine_idle(e)
