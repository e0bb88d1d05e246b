"""Cadence's CPU kernels built for other instruction sets than this machine's best, so the
code paths a CI box or a user's older CPU compiles are tested here too: AVX-512 without
its bfloat16 instructions (bfloat16 then goes through float32 FMAs), AVX2 (the portable
loops of the element-wise kernels, the AVX2 loops of the quantized projections), and plain
x86-64 without AVX (the quantized projections' portable loop). Each build runs the kernel,
quantized-projection and attention-backend unit tests in a fresh process against its own
cache directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cadence.kernels import cpu_kernels_available
from tests import isa_builds
from tests.isa_builds import BASE, MARCH, NEEDS, cpu_flags

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("isa,march", list(MARCH.items()))
def test_kernels_built_for_another_instruction_set_pass_the_kernel_tests(isa, march, tmp_path):
    if not cpu_kernels_available():
        pytest.skip(
            "Cadence's CPU kernels could not be built on this machine (see the log for why)"
        )
    if not NEEDS[isa] <= cpu_flags():
        pytest.skip(f"this CPU cannot run {isa} code")
    # Built in the background since the run began (tests/conftest.py), where it could be.
    cache = isa_builds.wait(isa) or str(tmp_path)
    env = dict(os.environ, CADENCE_CPU_KERNELS_CFLAGS=f"{BASE} {march}", CADENCE_CACHE_DIR=cache)
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
    assert os.listdir(os.path.join(cache, "kernels")), "no kernel build in the cache directory"
    probe = "import torch, cadence.kernels as k; k._load(); print(torch.ops.cadence.quant_isa())"
    isa_built = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
    ).stdout.split()[-1]
    assert isa_built == {"avx512-without-bf16": "avx512", "avx2": "avx2", "x86-64": "portable"}[isa]
