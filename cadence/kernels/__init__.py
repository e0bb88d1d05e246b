"""Cadence's own CPU kernels, registered as `torch.ops.cadence.*`: `csrc/cpu_ops.cpp` and the
quantized projections (`csrc/quant_layout.h` the tile layout, `quant_repack.cpp`,
`quant_products.cpp`, `quant_registration.cpp`, compiled as one unit by `quant_unit.cpp`:
the torch headers are most of a build's time).

They are compiled on this machine the first time they are needed (about a minute on 2 cores with the
system C++ compiler and ninja) and kept in the cache directory, keyed by the sources (headers included), the
torch version and the CPU's instruction set; later processes only load the library.
`python -m cadence.kernels` builds them ahead of time (the install script does).

Where they cannot be built (no compiler) or are turned off (`CADENCE_CPU_KERNELS=0`), the
CPU platform keeps torch's own ops: the same results, a slower decode step.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys

import torch

from cadence import envs

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = [os.path.join(CSRC, name) for name in ("cpu_ops.cpp", "quant_unit.cpp")]
# What the sources include: part of the cache key too.
HEADERS = [
    os.path.join(CSRC, name)
    for name in (
        "lora_products.cpp",
        "quant_layout.h",
        "quant_repack.cpp",
        "quant_products.cpp",
        "quant_registration.cpp",
    )
]
NAME = "cadence_cpu_ops"
# -ffast-math lets the compiler vectorize the float32 reductions and call the vector expf;
# glibc's libmvec provides it. OpenMP is torch's own runtime (same soname, loaded once).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _cflags() -> list[str]:
    return envs.cpu_kernels_cflags() or CFLAGS


def _build_dir() -> str:
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            key.update(f.read())
    key.update(torch.__version__.encode())
    key.update(" ".join(_cflags()).encode())
    try:  # -march=native: a library built for one CPU may not run on another
        with open("/proc/cpuinfo") as f:
            key.update(next((line for line in f if line.startswith("flags")), "").encode())
    except OSError:
        pass
    return os.path.join(envs.cache_dir(), "kernels", key.hexdigest()[:16])


def _load(verbose: bool = False) -> None:
    build_dir = _build_dir()
    library = os.path.join(build_dir, f"{NAME}.so")
    if os.path.exists(library):
        try:
            torch.ops.load_library(library)
            return
        except OSError:  # another process is still linking it: wait on its lock below
            pass
    from torch.utils.cpp_extension import load

    os.makedirs(build_dir, exist_ok=True)
    logger.info("building Cadence's CPU kernels in %s (once, about a minute)", build_dir)
    # load() takes a file lock on build_dir, so processes starting together build once.
    load(
        name=NAME,
        sources=SOURCES,
        extra_cflags=_cflags(),
        extra_ldflags=["-fopenmp"],
        build_directory=build_dir,
        is_python_module=False,
        verbose=verbose,
    )


@functools.lru_cache(maxsize=1)
def cpu_kernels_available() -> bool:
    """Builds (once per machine) and loads the kernels; False, with the reason logged, where
    that fails or `CADENCE_CPU_KERNELS=0` turns them off."""
    if not envs.cpu_kernels():
        return False
    try:
        _load()
        return True
    except Exception as e:  # no compiler, no ninja, a failed build: torch's ops serve instead
        logger.warning(
            "Cadence's CPU kernels are unavailable, decode falls back to torch ops (slower); "
            "install a C++ compiler (g++) and run `python -m cadence.kernels -v` to build them: %s",
            str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__,
        )
        return False


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not envs.cpu_kernels():
        print("CADENCE_CPU_KERNELS=0: nothing to build")
        return 0
    try:
        _load(verbose="-v" in sys.argv)
    except Exception as e:
        print(
            f"could not build Cadence's CPU kernels (the engine will use torch ops instead; a C++ compiler "
            f"such as g++ builds them, `python -m cadence.kernels -v` shows the build): {e}"
        )
        return 0  # not fatal: the install goes on
    print(f"Cadence's CPU kernels are ready ({_build_dir()})")
    return 0
