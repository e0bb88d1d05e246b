"""Cadence's CPU kernels built for other instruction sets, in the background from the start
of the run (tests/conftest.py), for tests/integration/test_cpu_kernels_isas.py.

Each build takes most of a minute of compiling. Started at nice 19 when the run begins, it
takes the CPU time the other tests leave idle (servers starting, clients waiting) instead
of a minute of the run's own; the ISA test then waits for its build, if it is not done yet,
and runs the kernel tests against it.
"""

from __future__ import annotations

import os
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

_builds: dict[str, tuple[subprocess.Popen, str]] = {}  # isa -> (its build, its cache dir)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(
                next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
            )
    except (OSError, StopIteration):
        return set()


def start(isas: list[str]) -> None:
    """Starts the builds of `isas` this CPU can run, each into a cache directory of its own."""
    flags = cpu_flags()
    for isa in isas:
        if isa in _builds or not NEEDS[isa] <= flags:
            continue
        cache = tempfile.mkdtemp(prefix=f"cadence-isa-{isa}-")
        env = dict(
            os.environ,
            CADENCE_CPU_KERNELS_CFLAGS=f"{BASE} {MARCH[isa]}",
            CADENCE_CACHE_DIR=cache,
        )
        # `nice` rather than a preexec_fn: the pytest process must not fork (tests/conftest.py).
        cmd = [sys.executable, "-m", "cadence.kernels"]
        proc = subprocess.Popen(
            ["nice", "-n", "19", *cmd] if shutil.which("nice") else cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _builds[isa] = (proc, cache)


def wait(isa: str) -> str | None:
    """The cache directory of `isa`'s background build once it has ended (the test builds
    there itself if it failed), or None when none was started."""
    if isa not in _builds:
        return None
    proc, cache = _builds[isa]
    proc.wait()
    return cache


def stop_all() -> None:
    for proc, cache in _builds.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(cache, ignore_errors=True)
    _builds.clear()
