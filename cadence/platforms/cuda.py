"""The built-in CUDA platform: NVIDIA GPUs through torch.cuda.

With triton installed (it comes with CUDA builds of torch), attention and the element-wise
layer ops are Cadence's Triton kernels (`cadence.layers.triton_layers`) and decode steps
replay CUDA graphs (`cadence.platforms.cuda_graph`); without it, the portable torch
backend runs eagerly and graph capture is not claimed.
"""

from __future__ import annotations

import functools

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

    def support_cuda_graph(self) -> bool:
        return _has_triton()  # the graphs capture the Triton layers

    def make_attention_backend(self, kv_pool, num_heads, num_kv_heads, head_dim):
        if not _has_triton():
            return super().make_attention_backend(kv_pool, num_heads, num_kv_heads, head_dim)
        from cadence.layers.triton_layers import TritonBackend

        return TritonBackend(kv_pool, num_heads, num_kv_heads, head_dim)

    def make_layer_ops(self):
        if not _has_triton():
            return super().make_layer_ops()
        from cadence.layers.triton_layers import TritonOps

        return TritonOps()

    def make_kv_pool(self, num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype):
        from cadence.mem_cache.kv_pool import KVPool

        # The scratch page takes the K/V a graph's padding rows write (cuda_graph.py).
        return KVPool(
            num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, self.device, True
        )

    def make_graph_runner(self, model_runner):
        from cadence.platforms.cuda_graph import DecodeGraphs

        return DecodeGraphs(
            model_runner.model,
            model_runner.kv_pool,
            model_runner.context_len,
            graph_rows(model_runner.args),
            self.device,
            model_runner.future_ids,
        )

    def init_backend(self) -> None:
        torch.cuda.set_device(self._index)


MAX_GRAPH_BATCH = 256  # --cuda-graph-max-bs unset: graphs up to this many rows


def graph_rows(args) -> int:
    """The most rows (a token each) a captured decode graph takes: --cuda-graph-max-bs, or
    MAX_GRAPH_BATCH, and no more than a step can have: a row per running request, or with
    speculative decoding a verify step's rows (each request's last token and its drafts)."""
    per_request = args.speculative_num_draft_tokens if args.speculative_algorithm else 1
    return min(args.cuda_graph_max_bs or MAX_GRAPH_BATCH, args.max_running_requests * per_request)


@functools.lru_cache(maxsize=1)
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
