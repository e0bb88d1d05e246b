"""The DeviceMixin -> SRTPlatform hierarchy: what the base classes leave to a platform, what
the built-in platforms implement, and the docs table of Active and Planned methods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cadence.platforms import (
    ACTIVE_METHODS,
    CpuArchEnum,
    DeviceCapability,
    DeviceMixin,
    Platform,
    PlatformEnum,
    SRTPlatform,
)
from cadence.platforms.cpu import CpuPlatform
from cadence.platforms.cuda import CudaPlatform
from cadence.platforms.interface import interface_methods

DOCS = Path(__file__).resolve().parents[3] / "docs" / "plugins.md"

# Every device operation of DeviceMixin, with arguments to call it with.
DEVICE_OPERATIONS = {
    "set_device": (0,),
    "get_device_name": (),
    "get_device_capability": (),
    "total_memory_bytes": (),
    "available_memory_bytes": (),
    "synchronize": (),
    "empty_cache": (),
    "seed": (3,),
    "make_generator": (3,),
    "profiler_activities": (),
    "get_torch_distributed_backend_str": (),
}


class BareDevice(DeviceMixin):
    name = "bare"
    device_type = "bare"


def test_the_hierarchy_and_the_name_plugins_subclass():
    assert issubclass(SRTPlatform, DeviceMixin) and Platform is SRTPlatform
    assert issubclass(CpuPlatform, SRTPlatform) and issubclass(CudaPlatform, SRTPlatform)
    assert CpuPlatform._enum is PlatformEnum.CPU and CudaPlatform._enum is PlatformEnum.CUDA
    assert {"CPU", "CUDA", "OOT"} <= set(PlatformEnum.__members__)


def test_every_device_operation_in_the_base_raises_naming_the_platform():
    bare = BareDevice()
    assert set(DEVICE_OPERATIONS) | {"device"} == {
        n for n in interface_methods() if n in vars(DeviceMixin)
    } - {"is_cpu", "is_cuda", "is_out_of_tree", "get_cpu_architecture"}
    for name, args in DEVICE_OPERATIONS.items():
        with pytest.raises(NotImplementedError, match="platform 'bare' does not provide"):
            getattr(bare, name)(*args)
    with pytest.raises(NotImplementedError, match="'bare'"):
        bare.device  # noqa: B018 - the property raises
    # Where a user can do without the operation, the message says how.
    with pytest.raises(NotImplementedError, match="set --max-total-tokens"):
        bare.available_memory_bytes()
    with pytest.raises(NotImplementedError, match="leave --random-seed unset"):
        bare.seed(1)
    assert "bare" in repr(bare)  # repr never touches the device


def test_the_cpu_platform_implements_every_device_operation():
    cpu = CpuPlatform()
    results = {name: getattr(cpu, name)(*args) for name, args in DEVICE_OPERATIONS.items()}
    assert cpu.device == torch.device("cpu")
    assert results["get_device_capability"] is None  # the host has no compute capability
    assert results["get_torch_distributed_backend_str"] == "gloo"
    assert isinstance(results["make_generator"], torch.Generator)
    assert cpu.get_compile_backend() == "inductor"
    assert not cpu.is_out_of_tree()


def test_the_cuda_platform_reads_its_capability_without_a_gpu_call_beyond_it(monkeypatch):
    """CUDA's answers that need no GPU: its backend, and its flags derived from the
    capability torch reports (patched here, so the test runs on any machine)."""
    cuda = CudaPlatform()
    assert cuda.get_torch_distributed_backend_str() == "nccl"
    assert cuda.is_cuda() and cuda.is_pin_memory_available()
    for reported, fp8 in [((9, 0), True), ((8, 9), True), ((8, 6), False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=reported: c)
        assert cuda.get_device_capability() == DeviceCapability(*reported)
        assert cuda.supports_fp8() is fp8


def test_device_capability_compares_in_order_and_writes_itself():
    cap = DeviceCapability(8, 9)
    assert cap >= (8, 0) and cap < DeviceCapability(9, 0)
    assert (cap.major, cap.minor, cap.as_version_str(), cap.to_int()) == (8, 9, "8.9", 89)
    with pytest.raises(ValueError, match="minor version 12"):
        DeviceCapability(1, 12).to_int()


@pytest.mark.parametrize(
    "machine, arch",
    [
        ("x86_64", CpuArchEnum.X86),
        ("AMD64", CpuArchEnum.X86),
        ("aarch64", CpuArchEnum.ARM),
        ("arm64", CpuArchEnum.ARM),
        ("riscv64", CpuArchEnum.UNSPECIFIED),
    ],
)
def test_cpu_architecture(monkeypatch, machine, arch):
    import cadence.platforms.device_mixin as device_mixin

    monkeypatch.setattr(device_mixin._host, "machine", lambda: machine)
    assert BareDevice().get_cpu_architecture() is arch


def _docs_table() -> dict[str, tuple[str, str]]:
    """{method: (class, Active|Planned)} from the table of "### The platform interface"."""
    text = DOCS.read_text()
    section = text[text.index("### The platform interface") :]
    section = section[: section.index("\n### ", 1)]
    rows = re.findall(
        r"^\| `(\w+)[^`]*`[^|]*\| (\w+) \| \*\*(Active|Planned)\*\* \|", section, re.MULTILINE
    )
    table = {name: (cls, status) for name, cls, status in rows}
    assert len(table) == len(rows), "a method is listed twice"
    return table


def test_the_docs_table_lists_every_method_and_agrees_with_active_methods():
    table = _docs_table()
    methods = set(interface_methods())
    assert methods - set(table) == set(), "methods missing from the docs table"
    assert set(table) - methods == set(), "the docs table lists methods the classes lack"
    for name, (cls, _) in table.items():
        owner = DeviceMixin if name in vars(DeviceMixin) else SRTPlatform
        assert cls == owner.__name__, f"{name} is a method of {owner.__name__}"
    documented_active = {name for name, (_, status) in table.items() if status == "Active"}
    assert documented_active == set(ACTIVE_METHODS)
    assert len(ACTIVE_METHODS) == len(set(ACTIVE_METHODS))
