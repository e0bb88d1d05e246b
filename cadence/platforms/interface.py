"""`SRTPlatform`: everything the engine needs to know about the device it runs on, on top of
`DeviceMixin` (device_mixin.py), as in SGLang's plugin design:

    DeviceMixin                      identity queries and device operations
    └── SRTPlatform(DeviceMixin)     + factories, capability flags, dtypes, lifecycle hooks
        ├── CpuPlatform, CudaPlatform          (built in)
        └── a vendor's platform                (out of tree, through an entry point)

`Platform` is the same class under the name plugins have always subclassed.

`ACTIVE_METHODS` names the methods the core calls today: a platform's override of one takes
effect. Every other method is part of the interface, but nothing calls it yet (Planned).
docs/plugins.md marks each, and tests/integration/test_platform_calls.py proves the Active
ones are called, through a platform that records its calls.

Importing it does not import torch: the front process resolves the platform (for its
defaults of the server arguments) and never computes; torch would add seconds to every
start. Each method that needs torch imports it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from cadence.platforms.device_mixin import (
    CpuArchEnum,
    DeviceCapability,
    DeviceMixin,
    PlatformEnum,
)

if TYPE_CHECKING:
    import torch

    from cadence.layers.attention import AttentionBackend
    from cadence.layers.layer_ops import LayerOps
    from cadence.layers.linear import Linear
    from cadence.mem_cache.allocator import KVAllocator
    from cadence.mem_cache.kv_pool import KVPool
    from cadence.server_args import ServerArgs

__all__ = [
    "ACTIVE_METHODS",
    "CpuArchEnum",
    "DeviceCapability",
    "DeviceMixin",
    "Platform",
    "PlatformEnum",
    "SRTPlatform",
    "TorchNativeFactories",
    "interface_methods",
]

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # of torch dtypes `--dtype` may name

ACTIVE_METHODS = (
    # DeviceMixin
    "is_out_of_tree",  # the resolver's log line
    "get_device_name",  # the resolver's log line
    "device",  # model and encoder runners: where the weights, the KV pool and batches go
    "available_memory_bytes",  # model runner: the KV budget when --max-total-tokens is unset
    "empty_cache",  # model runner: after a weight update
    "seed",  # model runner: --random-seed
    "make_generator",  # scheduler, through the runner: a request with a seed
    "profiler_activities",  # scheduler's profiler, through the runner: /start_profile
    # SRTPlatform
    "supports_bf16",  # through default_dtype
    "default_dtype",  # through resolve_dtype: --dtype auto
    "default_kv_cache_dtype",  # through resolve_kv_cache_dtype: --kv-cache-dtype auto
    "resolve_dtype",  # model and encoder runners
    "resolve_kv_cache_dtype",  # model runner
    "make_kv_pool",  # model runner
    "make_allocator",  # model and encoder runners
    "make_attention_backend",  # model runner
    "make_linear",  # model and encoder runners, at each (re)load of the weights
    "make_layer_ops",  # model runner
    "support_cuda_graph",  # model runner: whether it asks for a graph runner
    "make_graph_runner",  # model runner, where support_cuda_graph() and not --disable-cuda-graph
    "is_pin_memory_available",  # model runner: the host buffers of overlap scheduling
    "apply_server_args_defaults",  # cadence.hooks.finalize_server_args: front, Engine
    "init_backend",  # model and encoder runners, before any tensor is placed
    "weights_loading",  # model and encoder runners, before each load of the weights
    "weights_loaded",  # model and encoder runners, after each load of the weights
)
"""The methods the core calls today (docs/plugins.md says where). Keep in step with the docs
table; tests check both against the core's real calls."""


class SRTPlatform(DeviceMixin):
    """A device family Cadence can serve on: `DeviceMixin`'s identity and device operations,
    plus capability flags, dtypes, factories and lifecycle hooks.

    Invariants:
    - One instance per process, made by the resolver (`cadence.platforms.current_platform`).
      The engine asks it every device question and never branches on a device name itself.
    - Capability flags default to False: a platform claims only what it has verified. The
      core decides by a flag whether to call what it guards (`support_cuda_graph()` before
      `make_graph_runner`).
    - Factories raise NotImplementedError unless the platform provides them. The engine
      treats that as "this platform cannot do it", never as a cue to fall back silently.
      `make_linear` and `make_layer_ops` are the exceptions: torch's ops serve any device.
    - `apply_server_args_defaults` runs in the front process (and the in-process Engine)
      before `cadence.hooks.server_args_finalized`. `init_backend` runs in every process
      that builds a model, before any tensor is placed on the device; it must be idempotent.
      `weights_loading` runs there before each load of the weights, `weights_loaded` after.
    - Sampling runs where the logits are (the device); generators from `make_generator`
      are host generators, whose draws travel to the device (a seeded request's stream is
      the same on every platform).
    """

    # ---- capability flags (conservative) -----------------------------------------------

    def support_cuda_graph(self) -> bool:
        """Decode steps can be captured in device graphs and replayed (`make_graph_runner`)."""
        return False

    def support_piecewise_cuda_graph(self) -> bool:
        """Prefill can run as compiled pieces between attention calls (`get_compile_backend`)."""
        return False

    def supports_fp8(self) -> bool:
        """The device computes in 8-bit floats (fp8 weights or KV cache)."""
        return False

    def supports_bf16(self) -> bool:
        """bfloat16 is at least as fast as float32 here: `--dtype auto` picks it."""
        return False

    def is_pin_memory_available(self) -> bool:
        """Page-locked host buffers speed host-to-device copies (nothing to copy on the host)."""
        return False

    # ---- dtypes ----------------------------------------------------------------------

    def default_dtype(self) -> torch.dtype:
        """The weight and activation dtype `--dtype auto` means here."""
        import torch

        return torch.bfloat16 if self.supports_bf16() else torch.float32

    def default_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache dtype `--kv-cache-dtype auto` means here."""
        return model_dtype

    def resolve_dtype(self, name: str) -> torch.dtype:
        return self.default_dtype() if name == "auto" else _dtype(name)

    def resolve_kv_cache_dtype(self, name: str, model_dtype: torch.dtype) -> torch.dtype:
        return self.default_kv_cache_dtype(model_dtype) if name == "auto" else _dtype(name)

    # ---- factories (NotImplementedError unless provided) -----------------------------------

    def make_attention_backend(
        self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> AttentionBackend:
        raise NotImplementedError(f"platform {self.name!r} provides no attention backend")

    def make_kv_pool(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> KVPool:
        raise NotImplementedError(f"platform {self.name!r} provides no KV pool")

    def make_allocator(self, num_pages: int, page_size: int = 1) -> KVAllocator:
        raise NotImplementedError(f"platform {self.name!r} provides no KV page allocator")

    def make_linear(self, weight, bias: torch.Tensor | None = None) -> Linear:
        """The object a model projects through for one loaded weight (and optional bias).
        Unlike the other factories this one has a portable default, `F.linear` on the weight
        as loaded; a platform with a faster weight layout returns its own `Linear`.

        `weight` is a float tensor [out, in] or a `cadence.layers.quantized.QuantizedWeight`
        (a GGUF file's blocks, kept quantized). The default widens a quantized weight once to
        float32 (`DequantizedLinear`); a platform with kernels for the blocks returns a
        projection that reads them (the CPU platform's `QuantLinear`). A returned projection
        with `holds_weight` False lets the model free the weight it was built from."""
        from cadence.layers.linear import Linear
        from cadence.layers.quantized import QuantizedWeight, make_quantized_linear

        if isinstance(weight, QuantizedWeight):
            return make_quantized_linear(weight, bias, kernels=False)
        return Linear(weight, bias)

    def make_layer_ops(self) -> LayerOps:
        """The element-wise ops of a decoder layer (RMSNorm, SiLU, rotary, low-precision logits). Portable default:
        torch's ops; a platform with fused kernels returns its own `LayerOps`."""
        from cadence.layers.layer_ops import LayerOps

        return LayerOps()

    def make_graph_runner(self, model_runner: Any) -> Any:
        """The runner that captures `model_runner`'s decode steps in device graphs and replays
        them. Called only where `support_cuda_graph()` is True."""
        raise NotImplementedError(f"platform {self.name!r} provides no graph runner")

    def get_compile_backend(self, mode: str | None = None) -> str:
        """The torch.compile backend for this device (`mode`: a hint such as a graph mode)."""
        raise NotImplementedError(f"platform {self.name!r} provides no torch.compile backend")

    # ---- lifecycle -------------------------------------------------------------------

    def apply_server_args_defaults(self, args: ServerArgs) -> ServerArgs:
        """Returns the arguments with this platform's defaults filled in (ServerArgs is frozen:
        return `args.replace(...)`). Called once in the front process and in the Engine."""
        return args

    def init_backend(self) -> None:
        """Prepares the device for this process (threads, current device). Idempotent."""

    def weights_loading(self) -> None:
        """Runs in a model process before each load of the weights (at start, before a weight
        update), after `init_backend`: the moment to set how loading's memory is allocated."""

    def weights_loaded(self) -> None:
        """Runs in a model process each time the weights are in place (after the load, after a
        weight update): the moment to release what loading left behind and to settle the
        memory behaviour of the serving loop."""


class TorchNativeFactories:
    """The factories of the portable torch implementations, for platforms that use them."""

    if TYPE_CHECKING:  # the platform it is mixed into provides it

        @property
        def device(self) -> torch.device: ...

    def make_attention_backend(self, kv_pool, num_heads, num_kv_heads, head_dim):
        from cadence.layers.attention import TorchNativeBackend

        return TorchNativeBackend(kv_pool, num_heads, num_kv_heads, head_dim)

    def make_kv_pool(self, num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype):
        from cadence.mem_cache.kv_pool import KVPool

        return KVPool(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, self.device)

    def make_allocator(self, num_pages, page_size=1):
        from cadence.mem_cache.allocator import PageAllocator

        return PageAllocator(num_pages, page_size)

    def get_compile_backend(self, mode=None):
        return "inductor"  # torch's own compiler, for every device it generates code for


Platform = SRTPlatform
"""The name plugins subclass (specs/plugins.md): the same class as `SRTPlatform`."""


def interface_methods() -> tuple[str, ...]:
    """Every public method (and property) of `DeviceMixin` and `SRTPlatform`, in definition
    order: what the docs table lists and a recording platform watches."""
    names: list[str] = []
    for cls in (DeviceMixin, SRTPlatform):
        for name, attr in vars(cls).items():
            is_method = inspect.isfunction(attr) or isinstance(
                attr, (property, classmethod, staticmethod)
            )
            if is_method and not name.startswith("_") and name not in names:
                names.append(name)
    return tuple(names)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPE_NAMES:
        raise KeyError(name)
    import torch

    return getattr(torch, name)
