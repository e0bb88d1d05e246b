"""The built-in CPU platform: torch's portable kernels on the host."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from cadence import envs, glibc
from cadence.platforms.interface import (
    DeviceCapability,
    PlatformEnum,
    SRTPlatform,
    TorchNativeFactories,
)

if TYPE_CHECKING:
    import torch


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _meminfo_bytes(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def _mallopt() -> Callable[..., int] | None:
    """glibc's mallopt, or None where the C library is not glibc."""
    return glibc.function("mallopt", ctypes.c_int, ctypes.c_int)


def _load_outside_heap() -> bool:
    """Serve every allocation of 128 KiB or more from its own mapping while weights load, so
    that loading leaves no holes in the heap.

    Loading interleaves what it keeps (weights, packed tiles, the KV pool) with temporaries
    (dequantized tensors, packing buffers). In the heap, the freed temporaries leave a few
    hundred MiB of holes between kept blocks: the serving loop's steps then wander among
    them, each new shape of step faulting in holes no earlier step touched, so a server grew
    4-11% under load after taking a busy step's memory at start. In mappings of their own,
    temporaries go back to the OS when freed and kept blocks stay out of the heap: the heap
    the steps use holds only their own memory. A fixed threshold also turns off glibc's
    dynamic one, which rises to the size of the largest mapping freed and would send the
    next temporaries back to the heap. `_settle_heap` raises it again for serving. Returns
    False where the C library is not glibc."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, 128 << 10) == 1


def _settle_heap() -> bool:
    """Give back what loading left in the heap, then keep the memory of freed tensors in the
    process for the next step.

    Loading (GGUF dequantization, packing) may leave freed temporaries in the heap
    (`_load_outside_heap` keeps the larger ones out of it): `malloc_trim` returns them. Then,
    by default glibc serves every allocation above 128 KiB (a decode step's logits, a batch's
    MLP activations) with a fresh mmap and unmaps it on free, and trims the heap top back to
    the OS: each step faults its activations in again, page by page (up to ~1,500 page faults
    a step at batch 32, 5-20% of the step). Raising the mmap threshold to its 32 MiB maximum
    and the trim threshold to 128 MiB keeps that memory mapped; what a step frees the next one
    reuses, and a process holds at most ~128 MiB per allocation arena beyond what it uses.
    Returns False where the C library is not glibc.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return False
    malloc_trim = glibc.function("malloc_trim", ctypes.c_size_t)
    if malloc_trim is not None:
        malloc_trim(0)
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 128 << 20) == 1
    ok &= mallopt(_M_TOP_PAD, 16 << 20) == 1
    return bool(ok)


class CpuPlatform(TorchNativeFactories, SRTPlatform):
    name = "cpu"
    device_type = "cpu"
    _enum = PlatformEnum.CPU

    # ---- device operations: the host ---------------------------------------------------

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(
                f"platform {self.name!r} has a single device; got device index {index}"
            )

    def get_device_name(self) -> str:
        for line in _cpu_flags().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
        return "cpu"

    def get_device_capability(self) -> DeviceCapability | None:
        return None  # the host has ISA extensions (supports_bf16 reads them), not versions

    def total_memory_bytes(self) -> int:
        return _meminfo_bytes("MemTotal") or 8 << 30  # no /proc: assume a small machine

    def available_memory_bytes(self) -> int:
        return _meminfo_bytes("MemAvailable") or 8 << 30

    def synchronize(self) -> None:
        """Host ops finish before they return: nothing is ever queued."""

    def empty_cache(self) -> None:
        """torch keeps no cache of host memory; the C heap is settled in `weights_loaded`."""

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        import torch

        return torch.Generator(device="cpu").manual_seed(seed)

    def profiler_activities(self) -> list:
        import torch.profiler

        return [torch.profiler.ProfilerActivity.CPU]

    def get_torch_distributed_backend_str(self) -> str:
        return "gloo"

    # ---- capability flags, factories, lifecycle -----------------------------------------

    def supports_bf16(self) -> bool:
        # Without these instructions bfloat16 matmuls are emulated and slower than float32.
        flags = _cpu_flags()
        return "avx512_bf16" in flags or "amx_bf16" in flags

    def make_linear(self, weight, bias=None):
        from cadence.layers.linear import Linear, pack_or_plain
        from cadence.layers.quantized import QuantizedWeight, make_quantized_linear

        if isinstance(weight, QuantizedWeight):  # served as its blocks by Cadence's kernels
            from cadence.kernels import cpu_kernels_available

            return make_quantized_linear(weight, bias, kernels=cpu_kernels_available())
        return pack_or_plain(weight, bias) if envs.cpu_packed_linear() else Linear(weight, bias)

    def make_layer_ops(self):
        from cadence.kernels import cpu_kernels_available
        from cadence.layers.layer_ops import CpuFusedOps, LayerOps

        return CpuFusedOps() if cpu_kernels_available() else LayerOps()

    def make_attention_backend(self, kv_pool, num_heads, num_kv_heads, head_dim):
        from cadence.kernels import cpu_kernels_available
        from cadence.layers.attention import CpuPagedBackend

        if cpu_kernels_available():
            return CpuPagedBackend(kv_pool, num_heads, num_kv_heads, head_dim)
        return super().make_attention_backend(kv_pool, num_heads, num_kv_heads, head_dim)

    def apply_server_args_defaults(self, args):
        # The host computes each step before returning: there is nothing to overlap the next
        # step's preparation with (launching ahead would only run rows that turn out wasted).
        if not args.disable_overlap_schedule:
            args = args.replace(disable_overlap_schedule=True)
        return args

    def weights_loading(self) -> None:
        _load_outside_heap()

    def weights_loaded(self) -> None:
        _settle_heap()

    def init_backend(self) -> None:
        import torch

        num_threads = envs.num_threads()
        if num_threads is not None and torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
