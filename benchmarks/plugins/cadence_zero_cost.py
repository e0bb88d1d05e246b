"""A test/benchmark plugin: a model runner that returns tokens without computing anything.

Installed through the plugin system as a REPLACE of `ModelRunner` (a subclass, as REPLACE of
a class requires), so a server started with it runs every real part but the model: the
front processes, both protocols, the scheduler's batching and the detokenizer. A benchmark
can then drive the front to its ceiling (`benchmarks/bench_front.py`), and tests get tokens
as fast as the server can move them. Never a server flag: it exists only where
`CADENCE_PLUGINS=zero_cost` and this module's entry point are installed (`plugin_env`).

Tokens cycle through `CYCLE` (ordinary word pieces, never an end-of-sequence token), by
position, so two requests with the same prompt length get the same text. A step holding a
request whose rid starts with `PACED_PREFIX` takes `PACED_STEP_S` (tests that need a known,
unhurried token pace, whatever else the machine is doing).
"""

from __future__ import annotations

import os
import tempfile
import time

from cadence.plugins import HookType, plugin_hook

CYCLE = list(range(300, 364))  # 64 ordinary tokens of the SmolLM2 vocabulary
PACED_PREFIX = "paced-"
PACED_STEP_S = 0.05


def register() -> None:
    from cadence.model_executor.model_runner import ModelRunner
    from cadence.model_executor.runner import ItemResult

    @plugin_hook("cadence.model_executor.model_runner.ModelRunner", type=HookType.REPLACE)
    class ZeroCostRunner(ModelRunner):
        def run(self, batch):
            if any(item.rid.startswith(PACED_PREFIX) for item in batch.items):
                time.sleep(PACED_STEP_S)
            results = []
            for item in batch.items:
                result = ItemResult()
                if item.sampling is not None:
                    position = item.start + len(item.token_ids)
                    result.next_id = CYCLE[position % len(CYCLE)]
                    result.logprob = 0.0
                    k = item.sampling.top_logprobs_num
                    result.top_logprobs = [(0.0, result.next_id)] * min(k, 1)
                    given = item.sampling.token_ids_logprob or []
                    result.token_ids_logprobs = [(0.0, t) for t in given]
                result.input_logprobs = [(0.0, t) for t in item.logprob_targets]
                result.input_top = [[] for _ in item.logprob_rows]
                result.input_given = [[] for _ in item.logprob_rows]
                results.append(result)
            return results

    return ZeroCostRunner


def plugin_env() -> dict[str, str]:
    """The environment of a server with this plugin installed: this directory on PYTHONPATH
    and a dist-info directory declaring its entry point."""
    root = tempfile.mkdtemp(prefix="cadence-zero-cost-")
    info = os.path.join(root, "cadence_zero_cost-0.0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: cadence-zero-cost\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[cadence.plugins]\nzero_cost = cadence_zero_cost:register\n")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (root, here, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "CADENCE_PLUGINS": "zero_cost"}
