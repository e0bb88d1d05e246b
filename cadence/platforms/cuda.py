"""The built-in CUDA platform: NVIDIA GPUs through torch.cuda.

Attention uses the portable torch backend on the GPU (SDPA picks a fused kernel there);
no graph runner yet, so graph capture is not claimed.
"""

from __future__ import annotations

import torch

from cadence.platforms.interface import (
    DeviceCapability,
    PlatformEnum,
    SRTPlatform,
    TorchNativeFactories,
)


class CudaPlatform(TorchNativeFactories, SRTPlatform):
    name = "cuda"
    device_type = "cuda"
    _enum = PlatformEnum.CUDA

    def __init__(self) -> None:
        self._index = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._index)

    def set_device(self, index: int) -> None:
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(
                f"no CUDA device {index}: this machine has {torch.cuda.device_count()}"
            )
        torch.cuda.set_device(index)
        self._index = index

    def get_device_name(self) -> str:
        return torch.cuda.get_device_name(self._index)

    def get_device_capability(self) -> DeviceCapability:
        return DeviceCapability(*torch.cuda.get_device_capability(self._index))

    def total_memory_bytes(self) -> int:
        return torch.cuda.get_device_properties(self._index).total_memory

    def available_memory_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info(self._index)
        return free

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds the host and every CUDA device

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(seed)  # sampling runs on the host

    def get_torch_distributed_backend_str(self) -> str:
        return "nccl"

    def profiler_activities(self) -> list:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def supports_bf16(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def supports_fp8(self) -> bool:
        return self.get_device_capability() >= (8, 9)

    def is_pin_memory_available(self) -> bool:
        return True

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.supports_bf16() else torch.float16

    def init_backend(self) -> None:
        torch.cuda.set_device(self._index)
