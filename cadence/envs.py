"""Every environment variable Cadence reads, in one place."""

from __future__ import annotations

import os


def _get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value in (None, "") else value


def cache_dir() -> str:
    """CADENCE_CACHE_DIR: where converted tokenizers are kept (default ~/.cache/cadence)."""
    return os.path.expanduser(_get("CADENCE_CACHE_DIR", "~/.cache/cadence"))


def state_dir() -> str:
    """CADENCE_STATE_DIR: where a server keeps what it writes for the operator, such as
    profiler traces (default ~/.local/state/cadence)."""
    return os.path.expanduser(_get("CADENCE_STATE_DIR", "~/.local/state/cadence"))


PLATFORM_ENV = "CADENCE_PLATFORM"


def platform_name() -> str | None:
    """CADENCE_PLATFORM: the platform plugin to activate; unset picks one automatically."""
    return _get(PLATFORM_ENV)


def plugin_whitelist() -> list[str] | None:
    """CADENCE_PLUGINS: comma-separated general plugins to load; unset loads all, empty loads none."""
    value = os.environ.get("CADENCE_PLUGINS")
    return None if value is None else [p.strip() for p in value.split(",") if p.strip()]


def num_threads() -> int | None:
    """CADENCE_NUM_THREADS: torch intra-op threads for the model (default: all cores)."""
    value = _get("CADENCE_NUM_THREADS")
    return None if value is None else int(value)


def cpu_packed_linear() -> bool:
    """CADENCE_CPU_PACKED_LINEAR: 0 keeps CPU weights as loaded (plain F.linear) instead of
    reordering them once into oneDNN's packed layout (default 1; see cadence/layers/linear.py)."""
    return _get("CADENCE_CPU_PACKED_LINEAR", "1") not in ("0", "false", "no")


def pp_layer_partition() -> list[int] | None:
    """SGLANG_PP_LAYER_PARTITION: layers per pipeline stage, comma-separated (SGLang's
    variable), e.g. 12,18; default: an even load, the first stage's LM head counted."""
    value = _get("SGLANG_PP_LAYER_PARTITION")
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        raise ValueError(
            f"SGLANG_PP_LAYER_PARTITION must be layer counts separated by commas, got {value!r}"
        ) from None


def shm_collectives() -> bool:
    """CADENCE_SHM_COLLECTIVES: 0 keeps gloo for the all-reduces and logit gathers of
    tensor-parallel ranks on one machine instead of shared memory (default 1; see
    cadence/distributed/shm_collectives.py)."""
    return _get("CADENCE_SHM_COLLECTIVES", "1") not in ("0", "false", "no")


def cpu_kernels() -> bool:
    """CADENCE_CPU_KERNELS: 0 keeps torch's own ops on CPU instead of Cadence's fused kernels
    (built once per machine with the C++ compiler; see cadence/kernels)."""
    return _get("CADENCE_CPU_KERNELS", "1") not in ("0", "false", "no")


def cpu_kernels_cflags() -> list[str] | None:
    """CADENCE_CPU_KERNELS_CFLAGS: compiler flags for the CPU kernels instead of the defaults
    (space-separated), e.g. to build them for an older instruction set than this CPU's."""
    value = _get("CADENCE_CPU_KERNELS_CFLAGS")
    return None if value is None else value.split()


# A decode step is hundreds of small parallel torch ops. OpenMP's default (spin ~ms before
# sleeping) lets an idle worker hold a core another process needs: on a shared 2-core machine
# the served scheduler ran ~10x slower. OMP_WAIT_POLICY=PASSIVE avoids that but pays a futex
# wake-up (~40 us) on every op: ~40% slower decode on a quiet machine. A short spin (about
# 0.2 ms) covers the gaps inside a step and yields between steps.
DEFAULT_GOMP_SPINCOUNT = "20000"


def set_openmp_defaults() -> None:
    """Give processes started from here the short OpenMP spin, unless the environment already
    chose a wait policy. Must run before the process that reads it loads OpenMP."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = DEFAULT_GOMP_SPINCOUNT


def hicache_storage_dir() -> str | None:
    """Where the disk tier of the prefix cache keeps its pages (SGLang's variable name), when
    --hicache-storage-backend-extra-config gives no file_storage_path."""
    return _get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")


def _seconds(name: str, default: float) -> float:
    value = _get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    return seconds


def disaggregation_bootstrap_timeout() -> float:
    """SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (SGLang's name): seconds a disaggregated
    request's room waits for its other side (default 300)."""
    return _seconds("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)


def disaggregation_waiting_timeout() -> float:
    """SGLANG_DISAGGREGATION_WAITING_TIMEOUT (SGLang's name): seconds a decode server waits
    for a claimed request's KV pages (default 300)."""
    return _seconds("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
