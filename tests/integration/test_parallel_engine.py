"""Tensor and pipeline parallel ranks compute what one process computes.

Each configuration runs as an in-process `Engine` whose follower ranks are real processes
meeting over torch.distributed (gloo, TCP on this machine). The reference is the same model
on one rank. Compared: the log-probabilities of every prompt position's top 5 tokens and
of each greedy output token, quantized (the default GGUF's Q4_1/Q8_0 blocks, split whole)
and dense (the same file dequantized to float32).

Tolerance: 2e-3 in log-probability. The ranks' partial sums are added in another order
than one process adds them (float32), which moves logits by ~1e-5; the bound leaves room
for that and nothing more (a wrong head or shard moves them by whole units).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small"]
PARAMS = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
TOLERANCE = 2e-3
SMALL = {"max_total_tokens": 2048, "skip_warmup": True}


def _logprobs(engine) -> list[dict]:
    return engine.generate(
        PROMPTS, PARAMS, return_logprob=True, top_logprobs_num=5, logprob_start_len=0
    )


def _assert_close(ours: list[dict], ref: list[dict], what: str) -> None:
    for a, b in zip(ours, ref, strict=True):
        assert a["output_ids"] == b["output_ids"], what
        for key in ("input_top_logprobs", "output_top_logprobs"):
            for row_a, row_b in zip(a["meta_info"][key], b["meta_info"][key], strict=True):
                assert [t for _, t, _ in row_a] == [t for _, t, _ in row_b], (what, key)
                for (la, _, _), (lb, _, _) in zip(row_a, row_b):
                    assert abs(la - lb) <= TOLERANCE, (what, key, la, lb)


@pytest.fixture(scope="module", params=[False, True], ids=["quantized", "dense"])
def reference(request):
    from cadence import Engine

    engine = Engine(dtype="float32", dequantize=request.param, **SMALL)
    try:
        yield request.param, _logprobs(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "sizes", [{"tp_size": 2}, {"pp_size": 2}, {"tp_size": 2, "pp_size": 2}], ids=str
)
def test_parallel_ranks_give_the_single_process_logprobs(reference, sizes):
    from cadence import Engine

    dense, ref = reference
    engine = Engine(dtype="float32", dequantize=dense, **SMALL, **sizes)
    try:
        _assert_close(_logprobs(engine), ref, f"{sizes} dense={dense}")
        # Every rank's KV pool went back: nothing of these requests is held.
        assert engine.run_in_scheduler(lambda s: s.kv.usage().num_in_use) == 0
        # With stages, the three prompts decoded as two lanes in flight together.
        lanes = engine.run_in_scheduler(lambda s: s.runner.decode_lanes)
        launched = engine.run_in_scheduler(lambda s: getattr(s.runner, "lanes_launched", 0))
        assert lanes == sizes.get("pp_size", 1)
        assert (launched >= 2 * (PARAMS["max_new_tokens"] - 1)) == (lanes > 1), launched
    finally:
        engine.shutdown()
