"""load_plugins(): entry points, the CADENCE_PLUGINS whitelist, once per process (a forked
child loads again), and a failing plugin named in the error with every hook undone.

The entry points are real `EntryPoint` objects naming functions of a module made here; only
the discovery call is replaced, so the installed distributions do not matter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from importlib.metadata import EntryPoint

import pytest

from cadence.plugins import HookRegistry, PluginError, load_plugins, loader

MODULE = "cadence_test_loader_plugins"

SOURCE = """
from cadence.plugins import HookRegistry, HookType

calls = []

def target(x):
    return x

def register_a():
    calls.append("a")
    HookRegistry.register(f"{__name__}.target", lambda r, x: r + 1, HookType.AFTER)

def register_b():
    calls.append("b")
    HookRegistry.register(f"{__name__}.target", lambda r, x: r * 10, HookType.AFTER)

def register_broken():
    raise RuntimeError("the vendor SDK is missing")
"""


@pytest.fixture
def plugins(monkeypatch):
    module = types.ModuleType(MODULE)
    sys.modules[MODULE] = module
    exec(textwrap.dedent(SOURCE), module.__dict__)
    eps = [
        EntryPoint(name, f"{MODULE}:register_{name}", loader.PLUGIN_GROUP) for name in ("a", "b")
    ]

    def install(*extra: str) -> None:
        found = eps + [EntryPoint(n, f"{MODULE}:register_{n}", loader.PLUGIN_GROUP) for n in extra]
        monkeypatch.setattr(
            loader, "entry_points", lambda group: [e for e in found if e.group == group]
        )

    install()
    monkeypatch.setattr(loader, "_loaded_pid", None)
    monkeypatch.setattr(loader, "_loaded", [])
    monkeypatch.delenv("CADENCE_PLUGINS", raising=False)
    yield module, install
    HookRegistry.clear()
    sys.modules.pop(MODULE, None)


def test_loads_every_plugin_in_name_order_and_attributes_its_hooks(plugins):
    module, _ = plugins
    assert load_plugins() == ["a", "b"]
    assert module.target(1) == 20  # a's AFTER (+1) then b's (*10)
    assert sorted(HookRegistry.default().plugins()) == ["a", "b"]


def test_once_per_process(plugins):
    module, _ = plugins
    load_plugins()
    assert load_plugins() == ["a", "b"]
    assert module.calls == ["a", "b"]
    assert module.target(1) == 20


@pytest.mark.parametrize("value, expected", [("b", ["b"]), (" b , a ", ["a", "b"]), ("", [])])
def test_whitelist(plugins, monkeypatch, value, expected):
    module, _ = plugins
    monkeypatch.setenv("CADENCE_PLUGINS", value)
    assert load_plugins() == expected
    assert module.calls == expected


def test_whitelist_naming_a_missing_plugin_is_an_error(plugins, monkeypatch):
    monkeypatch.setenv("CADENCE_PLUGINS", "a,ghost")
    with pytest.raises(PluginError, match="'ghost'.*installed: a, b"):
        load_plugins()


def test_a_failing_plugin_stops_loading_names_itself_and_undoes_every_hook(plugins):
    module, install = plugins
    install("broken")
    with pytest.raises(PluginError, match="plugin 'broken'.*failed to load.*vendor SDK is missing"):
        load_plugins()
    assert module.target(1) == 1  # a's and b's hooks were removed again
    assert HookRegistry.default().hooks() == []


def test_a_whitelist_leaves_a_failing_plugin_out(plugins, monkeypatch):
    _, install = plugins
    install("broken")
    monkeypatch.setenv("CADENCE_PLUGINS", "a")
    assert load_plugins() == ["a"]


# Run in a fresh interpreter: fork() in the pytest process, which holds gRPC channels from
# other tests, runs gRPC's fork handlers there and can deadlock the whole run.
FORK_SCRIPT = """
import json, os, sys, textwrap, types
from importlib.metadata import EntryPoint
from cadence.plugins import load_plugins, loader

module = types.ModuleType(sys.argv[1])
sys.modules[sys.argv[1]] = module
exec(textwrap.dedent(sys.argv[2]), module.__dict__)
eps = [EntryPoint(n, f"{sys.argv[1]}:register_{n}", loader.PLUGIN_GROUP) for n in ("a", "b")]
loader.entry_points = lambda group: [e for e in eps if e.group == group]
load_plugins()
reader, writer = os.pipe()
pid = os.fork()
if pid == 0:  # the child: report what loading did here
    try:
        names = load_plugins()
        report = {
            "names": names, "calls": module.calls, "result": module.target(1), "pid": os.getpid()
        }
    except BaseException as e:
        report = {"error": repr(e)}
    os.write(writer, json.dumps(report).encode())
    os._exit(0)
os.close(writer)
with os.fdopen(reader) as f:
    child = json.loads(f.read())
os.waitpid(pid, 0)
print(json.dumps({"child": child, "pid": pid, "parent_calls": module.calls}))
"""


def test_a_forked_child_loads_again_and_registers_each_hook_once():
    env = {k: v for k, v in os.environ.items() if k != "CADENCE_PLUGINS"}
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, MODULE, SOURCE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout
    report = json.loads(out.splitlines()[-1])
    child = {"names": ["a", "b"], "calls": ["a", "b", "a", "b"], "result": 20, "pid": report["pid"]}
    assert report["child"] == child
    assert report["parent_calls"] == ["a", "b"]  # the parent did not load again
