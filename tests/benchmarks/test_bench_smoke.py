"""Every benchmark the README lists runs to completion: each one's `--smoke` mode (the whole
code path at its smallest size, on the default model) as its own process, as the README runs
it. A benchmark that breaks (a changed wire format, a renamed flag, a server that no longer
starts the way it asks) fails here instead of in the next person's hands.

Peers that need the network or a long build (llama.cpp's llama-server, smg, llguidance) are
used when they are already installed; otherwise the benchmark says so and reports Cadence
alone, which is what these runs then check. None of the figures is judged: a smoke run is
too short for that, and the machine is shared.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# name -> (extra arguments, with {out} for this run's folder; a line stdout must show)
SMOKE: dict[str, tuple[list[str], str]] = {
    "bench_offline.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"decode b32 "),
    "bench_serving.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"target: served"),
    "bench_router.py": (["--json", "{out}/r.json", "--png", "{out}/r.png"], r"ours added p50"),
    "bench_prefix_cache.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"hit_rate"),
    "bench_front.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"http_w2_vs_w1"),
    "bench_hicache.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"restart cold/warm"),
    "bench_grpc_vs_http.py": (
        ["--json", "{out}/r.json", "--plot", "{out}/r.png", "--with-smg"],
        r"gRPC streamed tok/s",
    ),
    "bench_embeddings.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"served_vs_st"),
    "bench_structured.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"compile ms"),
    "bench_grammar_engines.py": (["--json", "{out}/r.json"], r"mask per step p50"),
    "bench_quantized.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"c=2 "),
    "bench_relay.py": (["--json", "{out}/r.json", "--png", "{out}/r.png"], r"control round trip"),
    "bench_pd.py": (
        ["--json", "{out}/r.json", "--plot", "{out}/r.png"],
        r"transfer_vs_memcpy: \S+x \(target",
    ),
    "bench_parallel.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"all-reduce \["),
    "bench_lora.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"adapter load: "),
    "bench_speech.py": (["--json", "{out}/r.json", "--plot", "{out}/r.png"], r"served_vs_limit"),
    "bench_speculative.py": (
        ["--json", "{out}/r.json", "--plot", "{out}/r.png"],
        r"repeat_c1: speculation",
    ),
}

SMOKE_LIMIT_S = 600  # one benchmark's smoke run; they take seconds to a minute on 2 cores


def readme_benchmarks() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Where the numbers come from", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"benchmarks/(bench_\w+\.py)", section))


def test_every_benchmark_of_the_readme_has_a_smoke_run():
    listed = readme_benchmarks()
    assert listed, "the README's benchmark section lists no benchmarks/*.py"
    assert listed == set(SMOKE), (
        f"the README lists {sorted(listed - set(SMOKE))} without a smoke run here, or this "
        f"file runs {sorted(set(SMOKE) - listed)} that the README does not list"
    )
    for name in listed:
        assert (BENCHMARKS / name).exists(), f"the README lists {name}, which does not exist"


def run_smoke(name: str, out: Path) -> subprocess.CompletedProcess:
    extra, _ = SMOKE[name]
    cmd = [sys.executable, str(BENCHMARKS / name), "--smoke", *(a.format(out=out) for a in extra)]
    # Its own session: whatever it launched goes with it if it overruns.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=SMOKE_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{name} --smoke ran past {SMOKE_LIMIT_S} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_benchmark_smoke_run_completes(name, tmp_path):
    done = run_smoke(name, tmp_path)
    tail = f"\n--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{name} --smoke exited {done.returncode}{tail}"
    assert re.search(SMOKE[name][1], done.stdout), f"{name} printed no figures{tail}"
    figures = json.loads((tmp_path / "r.json").read_text())
    assert figures, f"{name} wrote no figures"
    for chart in tmp_path.glob("r.png"):
        assert chart.stat().st_size > 0
