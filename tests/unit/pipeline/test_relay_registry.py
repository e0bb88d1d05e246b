"""Relay backends by name: the built-ins, a plugin's through the `cadence.relays` entry-point
group (a real EntryPoint naming a module made here; only discovery is replaced), and an
unknown name answered with the ones available."""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint

import pytest

from cadence.pipeline.relay import base
from cadence.pipeline.relay.shm import ShmRelay
from cadence.pipeline.relay.torch_dist import TorchRelay

PLUGIN = "cadence_test_relay_plugin"


@pytest.fixture
def plugin_module(monkeypatch):
    module = types.ModuleType(PLUGIN)

    class FakeRelay(base.Relay):
        async def put_async(self, tensor, request_id, dst): ...

        async def get_async(self, metadata, dest, request_id): ...

        def cleanup(self, request_id): ...

        def close(self): ...

    module.FakeRelay = FakeRelay
    module.NotARelay = object
    monkeypatch.setitem(sys.modules, PLUGIN, module)
    points = [
        EntryPoint("fake", f"{PLUGIN}:FakeRelay", base.RELAY_GROUP),
        EntryPoint("broken", f"{PLUGIN}:NotARelay", base.RELAY_GROUP),
    ]
    monkeypatch.setattr(
        base, "entry_points", lambda group: points if group == base.RELAY_GROUP else []
    )
    monkeypatch.setattr(base, "_registry", dict(base._registry))
    return module


def test_builtins_by_name():
    assert base.relay_class("shm") is ShmRelay and ShmRelay.needs_ack
    assert base.relay_class("torch") is TorchRelay and not TorchRelay.can_replace_process


def test_a_plugin_backend_through_the_entry_point_group(plugin_module):
    cls = base.relay_class("fake")
    assert cls is plugin_module.FakeRelay and cls.name == "fake"
    assert base.available_relays() == ["broken", "fake", "shm", "torch"]
    with pytest.raises(ValueError, match="not a Relay subclass"):
        base.relay_class("broken")


def test_an_unknown_backend_lists_the_available_ones(plugin_module):
    with pytest.raises(
        ValueError, match="unknown relay backend 'nixl'; available: broken, fake, shm, torch"
    ):
        base.relay_class("nixl")


def test_register_relay_decorator(monkeypatch):
    monkeypatch.setattr(base, "_registry", dict(base._registry))

    @base.register_relay("mine")
    class Mine(ShmRelay):
        pass

    assert base.relay_class("mine") is Mine and Mine.name == "mine"
