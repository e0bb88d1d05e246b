"""Platform resolution rules, the lazy `current_platform`, and what the base and CPU
platforms promise. The entry points are real `EntryPoint` objects (the built-ins exactly
as pyproject.toml registers them); only the discovery call is replaced."""

from __future__ import annotations

import sys
import textwrap
import types
from importlib.metadata import EntryPoint

import pytest
import torch

import cadence.platforms as platforms
from cadence.platforms import Platform, PlatformError
from cadence.platforms.cpu import CpuPlatform

MODULE = "cadence_test_platform_plugins"

SOURCE = """
from cadence.platforms.cpu import CpuPlatform

class AltPlatform(CpuPlatform):
    name = "alt"

class OtherPlatform(CpuPlatform):
    name = "other"

class NotAPlatform:
    pass

def activate_alt():
    return f"{__name__}.AltPlatform"

def activate_other():
    return f"{__name__}:OtherPlatform"

def activate_absent():
    return None

def activate_boom():
    raise OSError("driver version mismatch")

def activate_bogus():
    return f"{__name__}.NotAPlatform"
"""

BUILTINS = [
    EntryPoint("cpu", "cadence.platforms.builtin:activate_cpu", platforms.PLATFORM_GROUP),
    EntryPoint("cuda", "cadence.platforms.builtin:activate_cuda", platforms.PLATFORM_GROUP),
]


@pytest.fixture
def installed(monkeypatch):
    """installed(*names): makes the built-ins plus these test platforms the installed ones."""
    module = types.ModuleType(MODULE)
    sys.modules[MODULE] = module
    exec(textwrap.dedent(SOURCE), module.__dict__)
    monkeypatch.delenv("CADENCE_PLATFORM", raising=False)

    def install(*names: str) -> None:
        eps = BUILTINS + [
            EntryPoint(n, f"{MODULE}:activate_{n}", platforms.PLATFORM_GROUP) for n in names
        ]
        monkeypatch.setattr(platforms, "_entry_points", lambda: eps)

    install()
    platforms.reset_current_platform()
    yield install
    platforms.reset_current_platform()
    sys.modules.pop(MODULE, None)


def test_no_plugin_picks_the_best_builtin(installed):
    platform = platforms.resolve_platform()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert platform.name == expected and not platform.is_out_of_tree()


def test_the_only_active_out_of_tree_platform_is_used(installed):
    installed("alt", "absent")
    platform = platforms.resolve_platform()
    assert platform.name == "alt" and platform.is_out_of_tree() and platform.is_cpu()


def test_inactive_out_of_tree_platforms_leave_the_builtin(installed):
    installed("absent")
    assert platforms.resolve_platform().name in ("cpu", "cuda")


def test_several_active_platforms_are_an_error_asking_for_cadence_platform(installed):
    installed("alt", "other")
    with pytest.raises(
        PlatformError, match=r"several platform plugins are active \(alt, other\).*CADENCE_PLATFORM"
    ):
        platforms.resolve_platform()


@pytest.mark.parametrize("name", ["other", "cpu"])
def test_cadence_platform_picks_one_even_among_several(installed, monkeypatch, name):
    installed("alt", "other")
    monkeypatch.setenv("CADENCE_PLATFORM", name)
    assert platforms.resolve_platform().name == name


def test_cadence_platform_activates_only_the_chosen_entry_point(installed, monkeypatch):
    installed("alt", "boom")  # boom would fail if it were activated
    monkeypatch.setenv("CADENCE_PLATFORM", "alt")
    assert platforms.resolve_platform().name == "alt"


def test_unknown_cadence_platform_is_an_error_listing_the_installed_ones(installed, monkeypatch):
    installed("alt")
    monkeypatch.setenv("CADENCE_PLATFORM", "tpu")
    with pytest.raises(PlatformError, match=r"CADENCE_PLATFORM='tpu'.*installed: alt, cpu, cuda"):
        platforms.resolve_platform()


def test_chosen_platform_without_its_hardware_is_an_error_not_a_fallback(installed, monkeypatch):
    installed("absent")
    monkeypatch.setenv("CADENCE_PLATFORM", "absent")
    with pytest.raises(PlatformError, match="platform 'absent'.*returned None"):
        platforms.resolve_platform()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cadence_platform_cuda_without_a_gpu_is_an_error(installed, monkeypatch):
    monkeypatch.setenv("CADENCE_PLATFORM", "cuda")
    with pytest.raises(PlatformError, match="platform 'cuda'.*returned None"):
        platforms.resolve_platform()


def test_a_failing_or_bogus_plugin_is_an_error_naming_it(installed, monkeypatch):
    installed("boom")
    with pytest.raises(PlatformError, match="platform plugin 'boom'.*driver version mismatch"):
        platforms.resolve_platform()
    installed("bogus")
    with pytest.raises(
        PlatformError, match="platform 'bogus'.*not a subclass of cadence.platforms.Platform"
    ):
        platforms.resolve_platform()


def test_two_packages_registering_one_name_is_an_error(installed, monkeypatch):
    eps = BUILTINS + [EntryPoint("cpu", f"{MODULE}:activate_alt", platforms.PLATFORM_GROUP)]
    monkeypatch.setattr(platforms, "_entry_points", lambda: eps)
    with pytest.raises(PlatformError, match="two installed packages register the platform 'cpu'"):
        platforms.resolve_platform()


def test_current_platform_resolves_once_on_first_use_and_records_where(installed, monkeypatch):
    installed("alt")
    assert platforms.resolved_at() is None
    assert "not resolved" in repr(platforms.current_platform)  # importing it resolved nothing
    assert platforms.current_platform.name == "alt"
    assert "test_platforms.py" in platforms.resolved_at()
    installed("alt", "other")  # would now be an error, but the platform is already chosen
    assert platforms.get_current_platform() is platforms.get_current_platform()
    assert platforms.current_platform.name == "alt"


def test_a_failed_resolution_is_not_cached(installed, monkeypatch):
    monkeypatch.setenv("CADENCE_PLATFORM", "nope")
    with pytest.raises(PlatformError):
        platforms.get_current_platform()
    monkeypatch.delenv("CADENCE_PLATFORM")
    assert platforms.get_current_platform().name in ("cpu", "cuda")


def test_base_platform_claims_nothing_and_provides_no_factories():
    class Bare(Platform):
        name = "bare"
        device_type = "bare"

    bare = Bare()
    assert not any(
        [
            bare.support_cuda_graph(),
            bare.support_piecewise_cuda_graph(),
            bare.supports_fp8(),
            bare.supports_bf16(),
            bare.is_pin_memory_available(),
            bare.is_cuda(),
            bare.is_cpu(),
            bare.is_out_of_tree(),
        ]
    )
    for make, args in [
        (bare.make_attention_backend, (None, 1, 1, 1)),
        (bare.make_kv_pool, (1, 1, 1, 1, 1, None)),
        (bare.make_allocator, (1,)),
        (bare.make_graph_runner, (None,)),
        (bare.get_compile_backend, ()),
        (bare.available_memory_bytes, ()),
        (bare.total_memory_bytes, ()),
        (bare.set_device, (0,)),
    ]:
        with pytest.raises(NotImplementedError, match="'bare'"):
            make(*args)
    assert bare.resolve_dtype("auto") == torch.float32  # no bf16 claimed
    assert bare.resolve_kv_cache_dtype("auto", torch.float16) == torch.float16
    with pytest.raises(NotImplementedError, match="set --max-total-tokens"):
        bare.available_memory_bytes()  # what a user can do about it


def test_cpu_platform_decisions():
    from cadence.layers.attention import TorchNativeBackend

    cpu = CpuPlatform()
    assert cpu.device == torch.device("cpu") and cpu.is_cpu() and not cpu.is_cuda()
    assert not cpu.support_cuda_graph() and not cpu.is_pin_memory_available()
    cpu.set_device(0)
    with pytest.raises(ValueError, match="single device"):
        cpu.set_device(1)
    assert cpu.resolve_dtype("auto") == (torch.bfloat16 if cpu.supports_bf16() else torch.float32)
    assert cpu.resolve_dtype("float16") == torch.float16
    assert cpu.resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cpu.resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert 0 < cpu.available_memory_bytes() <= cpu.total_memory_bytes()
    pool = cpu.make_kv_pool(
        num_pages=2, page_size=4, num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32
    )
    assert pool.kv_buffer[0].shape == (
        2,
        2,
        2,
        4,
        8,
    )  # [K/V, kv heads, pages, page, head dim] and pool.kv_buffer[0].device == cpu.device
    assert cpu.make_allocator(2).num_free_pages == 2
    assert isinstance(cpu.make_attention_backend(pool, 4, 2, 8), TorchNativeBackend)
    a, b = cpu.make_generator(7), cpu.make_generator(7)
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))
    cpu.synchronize()  # nothing queued on the host: returns at once
    cpu.empty_cache()


def probe_in_fresh_processes(script: str, *modes: str) -> dict[str, str]:
    """What `script` prints, run with each mode as its argument, each in a fresh process
    (glibc's thresholds move as a process frees large blocks); skips off glibc."""
    import platform
    import subprocess

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the C library is not glibc")
    return {
        mode: subprocess.run(
            [sys.executable, "-c", script, mode], capture_output=True, text=True, check=True
        ).stdout.strip()
        for mode in modes
    }


HEAP_PROBE = """
import sys, torch
if sys.argv[1] == "tuned":
    from cadence.platforms.cpu import CpuPlatform, _settle_heap
    CpuPlatform().weights_loaded()
    assert _settle_heap()
t = torch.empty(20 << 20, dtype=torch.uint8)
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        print("heap" if lo <= t.data_ptr() < hi else "mmap")
        break
else:
    print("mmap")
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc tuning is Linux-only"
)
def test_cpu_backend_serves_step_sized_tensors_from_the_heap_not_fresh_mmaps():
    """A 20 MiB activation comes from the heap once the CPU platform has settled it after a
    load (freed, it stays mapped for the next step), and from a fresh mmap, faulted in page
    by page on every step, in a process without that tuning. Fresh processes: the default threshold
    moves as a process frees large blocks."""
    assert probe_in_fresh_processes(HEAP_PROBE, "tuned", "default") == {
        "tuned": "heap",
        "default": "mmap",
    }


LOAD_PROBE = """
import sys, torch
if sys.argv[1] == "loading":
    from cadence.platforms.cpu import CpuPlatform
    CpuPlatform().weights_loading()
freed = torch.empty(8 << 20, dtype=torch.uint8)  # a loading temporary, mapped and then freed
del freed
kept = [torch.empty(n << 10, dtype=torch.uint8) for n in (256, 1024, 4096)]
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        break
else:
    lo = hi = 0
print(" ".join("heap" if lo <= t.data_ptr() < hi else "mmap" for t in kept))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc tuning is Linux-only"
)
def test_cpu_backend_loads_weights_outside_the_heap():
    """While weights load, blocks of 256 KiB to 4 MiB get mappings of their own, even after
    an 8 MiB one was freed; in a process without that tuning the freed block raises glibc's
    dynamic threshold and they land in the heap, where loading's freed temporaries would
    leave holes for the serving loop's steps to wander in."""
    assert probe_in_fresh_processes(LOAD_PROBE, "loading", "default") == {
        "loading": "mmap mmap mmap",
        "default": "heap heap heap",
    }


def test_cuda_graphs_are_sized_in_rows_so_verify_steps_replay_them():
    from cadence.platforms.cuda import MAX_GRAPH_BATCH, graph_rows
    from cadence.server_args import ServerArgs

    assert graph_rows(ServerArgs(max_running_requests=8)) == 8
    assert graph_rows(ServerArgs(max_running_requests=1024)) == MAX_GRAPH_BATCH
    spec = ServerArgs(
        max_running_requests=8, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8
    )
    assert graph_rows(spec) == 64  # each request's last token and up to 7 drafts
    assert graph_rows(ServerArgs(max_running_requests=8, cuda_graph_max_bs=4)) == 4


def test_device_picks_the_platform_for_this_process_and_those_it_starts(installed, monkeypatch):
    """--device (SGLang's flag): the same choice as CADENCE_PLATFORM, which it sets so that
    the scheduler and detokenizer processes resolve the same platform."""
    import os

    from cadence.hooks import finalize_server_args
    from cadence.server_args import ServerArgs

    installed("alt", "other")  # two active plugins: without a choice, an error
    monkeypatch.setenv("CADENCE_PLATFORM", "")
    finalize_server_args(ServerArgs(device="other"))
    assert platforms.get_current_platform().name == "other"
    assert os.environ["CADENCE_PLATFORM"] == "other"
    platforms.select_platform("other")  # the same again (a second Engine): fine
    with pytest.raises(PlatformError, match="already runs on the 'other' platform"):
        platforms.select_platform("alt")


def test_a_device_that_is_absent_unknown_or_contradicted_is_an_error(installed, monkeypatch):
    installed("absent")
    for name, words in (
        ("absent", "not available here"),
        ("npu", r"names no installed platform \(installed: absent, cpu, cuda\)"),
    ):
        with pytest.raises(PlatformError, match=words):
            platforms.select_platform(name)
    monkeypatch.setenv("CADENCE_PLATFORM", "cpu")
    with pytest.raises(PlatformError, match="contradicts CADENCE_PLATFORM='cpu'"):
        platforms.select_platform("absent")
