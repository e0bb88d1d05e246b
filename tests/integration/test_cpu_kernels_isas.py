"""Cadence's CPU kernels built for other instruction sets than this machine's best, so the
code paths a CI box or a user's older CPU compiles are tested here too: AVX-512 without
its bfloat16 instructions (bfloat16 then goes through float32 FMAs), AVX2 (the portable
loops of the element-wise kernels, the AVX2 loops of the quantized projections), and plain
x86-64 without AVX (the quantized projections' portable loop). Each build runs the kernel,
quantized-projection, attention-backend and LoRA-product unit tests in a fresh process against its own
cache directory. On a machine without AVX-512 the default build is the AVX2 one, which the
run's own kernel tests already cover: the AVX2 rebuild is skipped there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cadence.kernels import cpu_kernels_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = "-O3 -fopenmp -ffast-math"


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(
                next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
            )
    except (OSError, StopIteration):
        return set()


def native_isa() -> str:
    """The instruction set of the quantized products of this machine's default build."""
    import torch

    import cadence.kernels as kernels

    kernels._load()
    return torch.ops.cadence.quant_isa()


@pytest.mark.parametrize(
    "isa,march",
    [
        ("avx512-without-bf16", "-march=native -mno-avx512bf16"),
        ("avx2", "-march=x86-64-v3"),
        ("x86-64", "-march=x86-64"),
    ],
)
def test_kernels_built_for_another_instruction_set_pass_the_kernel_tests(isa, march, tmp_path):
    if not cpu_kernels_available():
        pytest.skip(
            "Cadence's CPU kernels could not be built on this machine (see the log for why)"
        )
    needed = {
        "avx512-without-bf16": {"avx512f", "avx512bw"},
        "avx2": {"avx2", "fma"},
        "x86-64": set(),
    }[isa]
    if not needed <= cpu_flags():
        pytest.skip(f"this CPU cannot run {isa} code")
    if isa == "avx2" and native_isa() == "avx2":
        # The same #if paths as an x86-64-v3 build: the kernel tests of this run cover it.
        pytest.skip("the default build of this machine is the AVX2 one, tested by this run")
    env = dict(
        os.environ, CADENCE_CPU_KERNELS_CFLAGS=f"{BASE} {march}", CADENCE_CACHE_DIR=str(tmp_path)
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/kernels/test_cpu_kernels.py",
            "tests/unit/kernels/test_quantized_kernels.py",
            "tests/unit/layers/test_attention_backend.py",
            "tests/unit/layers/test_lora_products.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[
        -1000:
    ]  # the kernels were built and ran
    assert os.listdir(tmp_path / "kernels"), "no kernel build in the test's cache directory"
    probe = "import torch, cadence.kernels as k; k._load(); print(torch.ops.cadence.quant_isa())"
    isa_built = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
    ).stdout.split()[-1]
    assert isa_built == {"avx512-without-bf16": "avx512", "avx2": "avx2", "x86-64": "portable"}[isa]
