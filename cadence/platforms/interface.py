"""The `Platform` seam: everything the engine needs to know about the device it runs on.

Importing it does not import torch: the front process resolves the platform (for its
defaults of the server arguments) and never computes; torch would add seconds to every
start. Each method that needs torch imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from cadence.layers.attention import AttentionBackend
    from cadence.layers.layer_ops import LayerOps
    from cadence.layers.linear import Linear
    from cadence.mem_cache.allocator import KVAllocator
    from cadence.mem_cache.kv_pool import KVPool
    from cadence.server_args import ServerArgs

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # of torch dtypes `--dtype` may name


class Platform:
    """A device family Cadence can run on: identity, device operations, capability flags,
    factories and lifecycle hooks.

    Invariants:
    - One instance per process, made by the resolver (`cadence.platforms.current_platform`).
      The engine asks it every device question and never branches on a device name itself.
    - Capability flags default to False: a platform claims only what it has verified.
    - Factories raise NotImplementedError unless the platform provides them. The engine
      treats that as "this platform cannot do it", never as a cue to fall back silently.
    - `apply_server_args_defaults` runs in the front process (and the in-process Engine)
      before `cadence.hooks.server_args_finalized`. `init_backend` runs in every process
      that builds a model, before any tensor is placed on the device; it must be idempotent.
      `weights_loaded` runs there after each load of the weights.
    - Sampling runs on the host today, so generators from `make_generator` are host
      generators and the model runner hands logits back on the host.
    """

    name: str = ""
    """The name users select with CADENCE_PLATFORM (the entry point's name)."""
    device_type: str = ""
    """The torch device type tensors are placed on ("cpu", "cuda", or a vendor's own)."""

    _out_of_tree: bool = False  # set by the resolver from where the entry point lives

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} on {self.device}>"

    # ---- identity --------------------------------------------------------------------

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_out_of_tree(self) -> bool:
        """True for a platform registered by a plugin rather than by Cadence itself."""
        return self._out_of_tree

    # ---- device operations -----------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the model, the KV pool and each forward batch live."""
        import torch

        return torch.device(self.device_type)

    def set_device(self, index: int) -> None:
        """Makes device `index` the one this process uses. Single-device platforms accept 0."""
        if index != 0:
            raise ValueError(
                f"platform {self.name!r} has a single device; got device index {index}"
            )

    def get_device_name(self) -> str:
        return self.device_type

    def total_memory_bytes(self) -> int:
        raise NotImplementedError(
            f"platform {self.name!r} does not report its memory; set --max-total-tokens"
        )

    def available_memory_bytes(self) -> int:
        """Free device memory now; the KV pool takes a share of it when --max-total-tokens is unset."""
        raise NotImplementedError(
            f"platform {self.name!r} does not report its memory; set --max-total-tokens"
        )

    def synchronize(self) -> None:
        """Waits until the device has finished all queued work (nothing to wait for by default)."""

    def empty_cache(self) -> None:
        """Returns cached, unused device memory to the system (no cache by default)."""

    def seed(self, seed: int) -> None:
        """Seeds the process-wide randomness (torch seeds the host and every device it knows)."""
        import torch

        torch.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        """A generator for one seeded request's sampling, which runs on the host."""
        import torch

        return torch.Generator(device="cpu").manual_seed(seed)

    def profiler_activities(self) -> list:
        """What torch.profiler records on this platform."""
        import torch.profiler

        return [torch.profiler.ProfilerActivity.CPU]

    # ---- capability flags (conservative) -----------------------------------------------

    def supports_graph_capture(self) -> bool:
        return False

    def supports_fp8(self) -> bool:
        return False

    def supports_bf16(self) -> bool:
        return False

    def supports_pinned_memory(self) -> bool:
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

    def make_graph_runner(self, model: torch.nn.Module, max_batch_size: int):
        raise NotImplementedError(f"platform {self.name!r} provides no graph runner")

    # ---- lifecycle -------------------------------------------------------------------

    def apply_server_args_defaults(self, args: ServerArgs) -> ServerArgs:
        """Returns the arguments with this platform's defaults filled in (ServerArgs is frozen:
        return `args.replace(...)`). Called once in the front process and in the Engine."""
        return args

    def init_backend(self) -> None:
        """Prepares the device for this process (threads, current device). Idempotent."""

    def weights_loaded(self) -> None:
        """Runs in a model process each time the weights are in place (after the load, after a
        weight update): the moment to release what loading left behind and to settle the
        memory behaviour of the serving loop."""


class TorchNativeFactories:
    """The factories of the portable torch implementations, for platforms that use them."""

    device: torch.device

    def make_attention_backend(self, kv_pool, num_heads, num_kv_heads, head_dim):
        from cadence.layers.attention import TorchNativeBackend

        return TorchNativeBackend(kv_pool, num_heads, num_kv_heads, head_dim)

    def make_kv_pool(self, num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype):
        from cadence.mem_cache.kv_pool import KVPool

        return KVPool(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, self.device)

    def make_allocator(self, num_pages, page_size=1):
        from cadence.mem_cache.allocator import PageAllocator

        return PageAllocator(num_pages, page_size)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPE_NAMES:
        raise KeyError(name)
    import torch

    return getattr(torch, name)
