"""`DeviceMixin`: the device half of a platform (SGLang's plugin design): who the device
is, and the operations on it that do not depend on what is served.

`SRTPlatform` (interface.py) adds what serving an LLM needs: factories, capability flags,
dtypes and lifecycle hooks. A vendor's platform subclasses `SRTPlatform` and implements the
device operations below for its device.

Importing it does not import torch (see interface.py): each method that needs torch imports it.
"""

from __future__ import annotations

import enum
import platform as _host
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class PlatformEnum(enum.Enum):
    """Which platform family an instance is. Built-ins name their own; the resolver marks
    every platform registered by a plugin `OOT`, whatever its class says."""

    CPU = enum.auto()
    CUDA = enum.auto()
    OOT = enum.auto()  # out of tree: registered by an installed plugin
    UNSPECIFIED = enum.auto()


class CpuArchEnum(enum.Enum):
    """The host CPU's architecture family (kernels and vector widths differ by it)."""

    X86 = enum.auto()
    ARM = enum.auto()
    UNSPECIFIED = enum.auto()


class DeviceCapability(NamedTuple):
    """A device's compute capability. A tuple, so capabilities compare in order:
    `DeviceCapability(9, 0) >= (8, 9)`."""

    major: int
    minor: int

    def as_version_str(self) -> str:
        """The form "8.9", as CUDA writes it (TORCH_CUDA_ARCH_LIST, nvcc's -arch)."""
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        """89 for 8.9: the form kernel tables and `sm_XX` names use."""
        if not 0 <= self.minor < 10:
            raise ValueError(f"minor version {self.minor} does not fit one digit of to_int()")
        return self.major * 10 + self.minor


_X86_MACHINES = ("x86_64", "amd64", "i386", "i686")
_ARM_MACHINES = ("aarch64", "arm64")


class DeviceMixin:
    """Identity queries and device operations of one device family.

    Invariants:
    - Device operations raise NotImplementedError here: a platform implements each for its
      device (the built-in cpu and cuda platforms implement them all). An operation with
      nothing to do on a device (synchronize on the host) is implemented as a no-op there,
      never inherited as one, so a new device cannot skip one by accident.
    - Identity queries are answered here from the class attributes and never touch the device.
    """

    name: str = ""
    """The name users select with CADENCE_PLATFORM (the entry point's name)."""
    device_type: str = ""
    """The torch device type tensors are placed on ("cpu", "cuda", or a vendor's own)."""
    _enum: PlatformEnum = PlatformEnum.UNSPECIFIED
    """The family (SGLang's name for it); the resolver sets OOT on a plugin's instance."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} on {self.device_type}>"

    def _unsupported(self, what: str, fix: str = "") -> NotImplementedError:
        """The error of an operation this platform does not provide; `fix` is what a user can
        change to do without it, when there is such a thing."""
        hint = f"; {fix}" if fix else f" (its {type(self).__name__} must implement it)"
        return NotImplementedError(f"platform {self.name!r} does not provide {what}{hint}")

    # ---- identity --------------------------------------------------------------------
    # is_cpu()/is_cuda() answer where tensors live (device_type), not which family the
    # platform is: an out-of-tree platform on the host (examples/plugins/cpu-alt) is both
    # is_out_of_tree() and is_cpu(). SGLang compares the enum, where an OOT one is neither.

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_out_of_tree(self) -> bool:
        """True for a platform registered by a plugin rather than by Cadence itself."""
        return self._enum is PlatformEnum.OOT

    def get_cpu_architecture(self) -> CpuArchEnum:
        """The host's architecture family (every platform has a host)."""
        machine = _host.machine().lower()
        if machine in _X86_MACHINES:
            return CpuArchEnum.X86
        if machine in _ARM_MACHINES:
            return CpuArchEnum.ARM
        return CpuArchEnum.UNSPECIFIED

    # ---- device operations (NotImplementedError unless the platform implements them) ---

    @property
    def device(self) -> torch.device:
        """Where the model, the KV pool and each forward batch live."""
        raise self._unsupported("a torch device")

    def set_device(self, index: int) -> None:
        """Makes device `index` the one this process uses."""
        raise self._unsupported("set_device()")

    def get_device_name(self) -> str:
        """The device's model name, for logs and /get_server_info."""
        raise self._unsupported("a device name")

    def get_device_capability(self) -> DeviceCapability | None:
        """The device's compute capability, or None where the device has no such versioning."""
        raise self._unsupported("a device capability")

    def total_memory_bytes(self) -> int:
        raise self._unsupported("its memory size", "set --max-total-tokens")

    def available_memory_bytes(self) -> int:
        """Free device memory now; the KV pool takes a share of it when --max-total-tokens is unset."""
        raise self._unsupported("its free memory", "set --max-total-tokens")

    def synchronize(self) -> None:
        """Waits until the device has finished all queued work."""
        raise self._unsupported("synchronize()")

    def empty_cache(self) -> None:
        """Returns cached, unused device memory to the system (after a weight update)."""
        raise self._unsupported("empty_cache()")

    def seed(self, seed: int) -> None:
        """Seeds the process-wide randomness of the host and the device (--random-seed)."""
        raise self._unsupported("seed()", "leave --random-seed unset")

    def make_generator(self, seed: int) -> torch.Generator:
        """A generator for one seeded request's sampling, on the device sampling runs on."""
        raise self._unsupported("per-request generators", "send requests without a seed")

    def profiler_activities(self) -> list:
        """What torch.profiler records on this platform (/start_profile)."""
        raise self._unsupported("profiler activities", "do not start the profiler")

    def get_torch_distributed_backend_str(self) -> str:
        """The torch.distributed backend for this device's collectives ("gloo", "nccl")."""
        raise self._unsupported("a torch.distributed backend")
