"""Cadence's CPU kernels built for other instruction sets, in the background from the start
of the run (tests/conftest.py), for tests/integration/test_cpu_kernels_isas.py.

Each build takes most of a minute of compiling. Started at nice 10 when the run begins, it
takes the CPU time the other tests leave idle (servers starting, clients waiting) instead
of a minute of the run's own; the ISA test then waits for its build, if it is not done yet,
and runs the kernel tests against it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile

BASE = "-O3 -fopenmp -ffast-math"
MARCH = {
    "avx512-without-bf16": "-march=native -mno-avx512bf16",
    "avx2": "-march=x86-64-v3",
    "x86-64": "-march=x86-64",
}
NEEDS = {"avx512-without-bf16": {"avx512f", "avx512bw"}, "avx2": {"avx2", "fma"}, "x86-64": set()}

_chain: subprocess.Popen | None = None  # the builds, one after another
_caches: dict[str, str] = {}  # isa -> its cache directory

# Runs each build in turn (two compilers at most, MAX_JOBS=2, as a build alone would),
# so the builds add little memory to a run that already holds a dozen servers.
_CHAIN = """
import json, os, subprocess, sys
for env in json.loads(sys.argv[1]):
    subprocess.run([sys.executable, "-m", "cadence.kernels"], env={**os.environ, **env},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(
                next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
            )
    except (OSError, StopIteration):
        return set()


def start(isas: list[str]) -> None:
    """Starts the builds of `isas` this CPU can run, each into a cache directory of its own,
    one after another at a low priority (nice 10: mostly the CPU the tests leave idle, yet
    still a tenth of a core on a machine the tests keep busy)."""
    global _chain
    flags = cpu_flags()
    envs = []
    for isa in dict.fromkeys(isas):
        if isa in _caches or not NEEDS[isa] <= flags:
            continue
        _caches[isa] = tempfile.mkdtemp(prefix=f"cadence-isa-{isa}-")
        envs.append(
            {
                "CADENCE_CPU_KERNELS_CFLAGS": f"{BASE} {MARCH[isa]}",
                "CADENCE_CACHE_DIR": _caches[isa],
                "MAX_JOBS": "2",
            }
        )
    if not envs:
        return
    # `nice` rather than a preexec_fn: the pytest process must not fork (tests/conftest.py).
    cmd = [sys.executable, "-c", _CHAIN, json.dumps(envs)]
    _chain = subprocess.Popen(
        ["nice", "-n", "10", *cmd] if shutil.which("nice") else cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait(isa: str) -> str | None:
    """The cache directory of `isa`'s background build once the builds have ended (the test
    builds there itself if its build failed), or None when none was started."""
    if isa not in _caches:
        return None
    if _chain is not None:
        _chain.wait()
    return _caches[isa]


def stop_all() -> None:
    global _chain
    if _chain is not None and _chain.poll() is None:
        _chain.kill()
        _chain.wait()
    _chain = None
    for cache in _caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    _caches.clear()
