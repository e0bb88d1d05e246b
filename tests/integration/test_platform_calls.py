"""The core calls every Active platform method, and no Planned one (docs/plugins.md, "The
platform interface"): a platform that records its calls is chosen through the resolver, as a
plugin's would be, and serves the real model in an in-process Engine.

The Engine runs its scheduler, and so the model runner, on a thread of this process: the
record is read here directly. A `cadence serve` scheduler process would need it sent back.
"""

from __future__ import annotations

import functools
import os
from importlib.metadata import EntryPoint

import pytest

import cadence.platforms as platforms
from cadence.platforms import ACTIVE_METHODS
from cadence.platforms.cpu import CpuPlatform
from cadence.platforms.interface import interface_methods

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WATCHED = frozenset(interface_methods())

# Methods the core calls only where the platform claims a capability flag (the flag itself
# is what it calls everywhere). The CPU platform claims none, so none of these is expected.
GUARDED_BY_FLAG = {"make_graph_runner": "support_cuda_graph"}


class RecordingPlatform(CpuPlatform):
    """The CPU platform, recording the name of each DeviceMixin/SRTPlatform method called on
    it (reading the `device` property counts as calling it), from any thread and from the
    platform's own methods alike (`resolve_dtype` calling `default_dtype`)."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.called: set[str] = set()

    def __getattribute__(self, name: str):
        attr = object.__getattribute__(self, name)
        if name not in WATCHED:
            return attr
        called = object.__getattribute__(self, "called")
        if not callable(attr):  # a property: reading it is the call
            called.add(name)
            return attr

        @functools.wraps(attr)
        def record(*args, **kwargs):
            called.add(name)
            return attr(*args, **kwargs)

        return record


def activate_recording() -> str:
    return f"{__name__}.RecordingPlatform"


@pytest.fixture
def recording_platform(monkeypatch):
    """Installs the recording platform beside the built-ins and selects it, as
    CADENCE_PLATFORM selects a plugin; the process's platform is resolved afresh."""
    group = platforms.PLATFORM_GROUP
    eps = [
        EntryPoint("cpu", "cadence.platforms.builtin:activate_cpu", group),
        EntryPoint("recording", f"{__name__}:activate_recording", group),
    ]
    monkeypatch.setattr(platforms, "_entry_points", lambda: eps)
    monkeypatch.setenv("CADENCE_PLATFORM", "recording")
    platforms.reset_current_platform()
    yield
    platforms.reset_current_platform()  # later engines get the machine's own platform


def test_the_core_calls_every_active_method_and_no_planned_one(recording_platform, tmp_path):
    from cadence import Engine
    from cadence.model_loader.locate import default_model_path

    # Each Active method is reached by a path the core really takes: dtypes left to the
    # platform (auto), the KV budget from its free memory (no --max-total-tokens), a
    # --random-seed, a seeded request, a profile, and a weight update.
    with Engine(
        model_path=None, random_seed=0, max_running_requests=2, profile_dir=str(tmp_path)
    ) as engine:
        platform = engine.scheduler.runner.platform
        assert isinstance(platform, RecordingPlatform) and platform.is_out_of_tree()
        out = engine.generate(
            "The capital of France is",
            {"max_new_tokens": 4, "temperature": 1.0, "seed": 7, "ignore_eos": True},
        )
        assert len(out["output_ids"]) == 4
        started = engine.start_profile()
        assert started.success, started.message
        stopped = engine.stop_profile()
        assert stopped.success and os.path.isfile(stopped.message), stopped.message
        assert out["meta_info"]["weight_version"] == engine.get_weight_version() == "default"
        updated = engine.update_weights_from_disk(default_model_path(), weight_version="w2")
        assert updated.success, updated.message
        again = engine.generate(
            "The capital of France is",
            {"max_new_tokens": 4, "temperature": 1.0, "seed": 7, "ignore_eos": True},
        )
        assert again["output_ids"] == out["output_ids"]  # same weights, same seed
        assert again["meta_info"]["weight_version"] == "w2"
        assert engine.update_weight_version("w3").new_version == engine.get_weight_version()

    called = platform.called
    expected = set(ACTIVE_METHODS) - set(GUARDED_BY_FLAG)
    assert expected - called == set(), (
        "marked Active (ACTIVE_METHODS, docs/plugins.md) but never called by the core"
    )
    assert called - set(ACTIVE_METHODS) == set(), (
        "called by the core but marked Planned: move it to ACTIVE_METHODS and the docs table"
    )
