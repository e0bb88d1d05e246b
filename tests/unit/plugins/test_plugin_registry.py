"""HookRegistry on real modules made for each test: every hook type on sync and async
functions and methods, class REPLACE, collisions, attribution, stale-import propagation."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import types

import pytest

from cadence.plugins import HookRegistry, HookType, PluginError, plugin_hook, resolve_target
from cadence.plugins.registry import attributed_to

TARGETS = "cadence_test_targets"
CONSUMER = "cadence_test_consumer"

TARGET_SOURCE = """
import asyncio

def double(x):
    return 2 * x

async def adouble(x):
    await asyncio.sleep(0)
    return 2 * x

def numbers():
    yield 1

class Calc:
    def double(self, x):
        return 2 * x

    async def adouble(self, x):
        await asyncio.sleep(0)
        return 2 * x

    @staticmethod
    def sdouble(x):
        return 2 * x

    @classmethod
    def name(cls):
        return cls.__name__

class SubCalc(Calc):
    pass
"""


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(textwrap.dedent(source), module.__dict__)
    return module


@pytest.fixture
def targets():
    module = _module(TARGETS, TARGET_SOURCE)
    yield module
    sys.modules.pop(TARGETS, None)
    sys.modules.pop(CONSUMER, None)


@pytest.fixture
def registry(targets):
    reg = HookRegistry()
    yield reg
    reg.clear()


def _call(targets, kind: str, x: int):
    """Calls the target of `kind` the way a caller would and returns its (awaited) result."""
    if kind == "function":
        return targets.double(x)
    if kind == "async function":
        return asyncio.run(targets.adouble(x))
    if kind == "method":
        return targets.Calc().double(x)
    return asyncio.run(targets.Calc().adouble(x))


PATHS = {
    "function": "double",
    "async function": "adouble",
    "method": "Calc.double",
    "async method": "Calc.adouble",
}


def _hook(kind: str, hook_type: HookType):
    """A hook of `hook_type` suited to a target of `kind`; the last positional argument is x."""
    is_async = kind.startswith("async")
    if hook_type is HookType.BEFORE:
        return lambda *args, **kwargs: (args[:-1] + (args[-1] + 1,), kwargs)
    if hook_type is HookType.AFTER:
        if is_async:

            async def after(result, *args, **kwargs):
                assert isinstance(result, int)  # the awaited result, not a coroutine
                return result + 1000

            return after
        return lambda result, *args, **kwargs: result + 1000
    if hook_type is HookType.AROUND:
        if is_async:

            async def around(original, *args, **kwargs):
                return await original(*args, **kwargs) * 10

            return around
        return lambda original, *args, **kwargs: original(*args, **kwargs) * 10
    if is_async:

        async def replacement(*args, **kwargs):
            return -args[-1]

        return replacement
    return lambda *args, **kwargs: -args[-1]


EXPECTED = {HookType.BEFORE: 8, HookType.AFTER: 1006, HookType.AROUND: 60, HookType.REPLACE: -3}


@pytest.mark.parametrize("hook_type", list(HookType), ids=lambda t: t.name)
@pytest.mark.parametrize("kind", list(PATHS))
def test_each_hook_type_on_each_kind_of_target(targets, registry, kind, hook_type):
    assert _call(targets, kind, 3) == 6
    registry.register(f"{TARGETS}.{PATHS[kind]}", _hook(kind, hook_type), hook_type, plugin="p")
    assert _call(targets, kind, 3) == EXPECTED[hook_type]
    registry.clear()
    assert _call(targets, kind, 3) == 6


def test_hooks_returning_none_change_nothing(targets, registry):
    seen = []
    registry.register(
        f"{TARGETS}.double", lambda *a, **k: seen.append(("before", a)), HookType.BEFORE
    )
    registry.register(
        f"{TARGETS}.double", lambda r, *a, **k: seen.append(("after", r, a)), HookType.AFTER
    )
    assert targets.double(5) == 10
    assert seen == [("before", (5,)), ("after", 10, (5,))]


def test_hooks_run_in_registration_order_and_the_first_around_is_outermost(targets, registry):
    target = f"{TARGETS}.double"
    registry.register(target, lambda x: ((x + 1,), {}), HookType.BEFORE)
    registry.register(target, lambda x: ((x * 10,), {}), HookType.BEFORE)
    registry.register(target, lambda orig, x: f"a({orig(x)})", HookType.AROUND)
    registry.register(target, lambda orig, x: f"b({orig(x)})", HookType.AROUND)
    registry.register(target, lambda r, x: r + "+", HookType.AFTER)
    registry.register(target, lambda r, x: r + "*", HookType.AFTER)
    assert targets.double(1) == "a(b(40))+*"


def test_static_and_class_methods_keep_their_kind(targets, registry):
    registry.register(f"{TARGETS}.Calc.sdouble", lambda r, x: r + 1, HookType.AFTER)
    registry.register(f"{TARGETS}.Calc.name", lambda r, cls: r + "!", HookType.AFTER)
    assert targets.Calc.sdouble(2) == 5 and targets.Calc().sdouble(2) == 5
    assert targets.Calc.name() == "Calc!" and targets.SubCalc.name() == "SubCalc!"
    registry.clear()
    assert targets.Calc.sdouble(2) == 4 and targets.SubCalc.name() == "SubCalc"


def test_inherited_method_hooked_on_the_subclass_only(targets, registry):
    registry.register(f"{TARGETS}.SubCalc.double", lambda r, self, x: r + 1, HookType.AFTER)
    assert targets.SubCalc().double(1) == 3 and targets.Calc().double(1) == 2
    registry.clear()
    assert "double" not in vars(targets.SubCalc)  # inherited again, not a copy
    assert targets.SubCalc().double(1) == 2


def test_both_target_spellings_name_one_target(targets, registry):
    assert resolve_target(f"{TARGETS}.Calc.double") == resolve_target(f"{TARGETS}:Calc.double")
    assert resolve_target("cadence.hooks.request_finished")[1] == "request_finished"
    registry.register(f"{TARGETS}:Calc.double", lambda *a: 0, HookType.REPLACE, plugin="first")
    with pytest.raises(PluginError, match="'first' and 'second' both REPLACE"):
        registry.register(f"{TARGETS}.Calc.double", lambda *a: 1, HookType.REPLACE, plugin="second")


def test_replace_collision_names_both_plugins_and_keeps_the_first(targets, registry):
    registry.register(f"{TARGETS}.double", lambda x: "alpha", HookType.REPLACE, plugin="alpha")
    with pytest.raises(PluginError) as info:
        registry.register(f"{TARGETS}.double", lambda x: "beta", HookType.REPLACE, plugin="beta")
    assert "'alpha'" in str(info.value) and "'beta'" in str(info.value)
    assert targets.double(1) == "alpha"


def test_bad_targets_and_hooks_are_plugin_errors(targets, registry):
    with pytest.raises(PluginError, match="no attribute 'missing'"):
        registry.register(f"{TARGETS}.Calc.missing", print, HookType.AFTER)
    with pytest.raises(PluginError, match="no module"):
        registry.register("cadence_no_such_module:thing", print, HookType.AFTER)
    with pytest.raises(PluginError, match="only REPLACE accepts a class"):
        registry.register(f"{TARGETS}.Calc", print, HookType.AFTER)
    with pytest.raises(PluginError, match="generator function"):
        registry.register(f"{TARGETS}.numbers", print, HookType.BEFORE)
    with pytest.raises(PluginError, match="async function"):
        registry.register(f"{TARGETS}.adouble", lambda x: x, HookType.REPLACE)
    with pytest.raises(PluginError, match="must return None or"):
        registry.register(f"{TARGETS}.double", lambda x: x, HookType.BEFORE)
        targets.double(1)


def test_replace_a_class_keeps_isinstance_working(targets, registry):
    original = targets.Calc
    consumer = _module(CONSUMER, f"from {TARGETS} import Calc\n")

    class LoudCalc(original):
        def double(self, x):
            return f"{super().double(x)}!"

    registry.register(f"{TARGETS}.Calc", LoudCalc, HookType.REPLACE, plugin="loud")
    made = consumer.Calc()  # the name imported before the hook now makes the replacement
    assert made.double(2) == "4!"
    assert isinstance(made, original) and isinstance(made, targets.Calc)
    assert issubclass(targets.Calc, original)
    with pytest.raises(PluginError, match="must subclass"):
        registry.register(f"{TARGETS}.SubCalc", type("Unrelated", (), {}), HookType.REPLACE)
    registry.clear()
    assert consumer.Calc is original and targets.Calc is original


def test_patches_reach_names_imported_before_the_hook(targets, registry):
    consumer = _module(
        CONSUMER,
        f"""
        from {TARGETS} import double, adouble

        def use(x):
            return double(x)
        """,
    )
    registry.register(f"{TARGETS}.double", lambda r, x: r + 1, HookType.AFTER)
    registry.register(f"{TARGETS}.adouble", lambda r, x: r + 1, HookType.AFTER)
    assert consumer.use(2) == 5 and consumer.double(2) == 5
    assert asyncio.run(consumer.adouble(2)) == 5
    registry.clear()
    assert consumer.use(2) == 4 and consumer.double is targets.double


def test_a_hooks_own_module_keeps_the_original(targets, registry):
    """A replacement calling the original by its imported name does not call itself."""
    plugin = _module(
        "cadence_test_plugin_module",
        f"""
        from {TARGETS} import double

        def doubled_twice(x):
            return double(double(x))
        """,
    )
    try:
        registry.register(f"{TARGETS}.double", plugin.doubled_twice, HookType.REPLACE)
        assert targets.double(1) == 4
    finally:
        sys.modules.pop("cadence_test_plugin_module", None)


def test_each_hook_is_attributed_to_its_plugin(targets, registry):
    with attributed_to("alpha"):
        registry.register(f"{TARGETS}.double", lambda r, x: None, HookType.AFTER)
    registry.register(f"{TARGETS}.Calc.double", lambda r, s, x: None, HookType.AFTER, plugin="beta")
    assert [h.plugin for h in registry.hooks(f"{TARGETS}.double")] == ["alpha"]
    assert sorted(registry.plugins()) == ["alpha", "beta"]
    registry.clear(plugin="alpha")
    assert sorted(registry.plugins()) == ["beta"] and registry.hooks(f"{TARGETS}.double") == []


def test_an_exception_from_a_hook_carries_its_plugin(targets, registry):
    def broken(x):
        raise ValueError("nope")

    registry.register(f"{TARGETS}.double", broken, HookType.BEFORE, plugin="gamma")
    with pytest.raises(ValueError) as info:
        targets.double(1)
    assert any("'gamma'" in note and "BEFORE" in note for note in info.value.__notes__)


def test_class_level_calls_use_the_process_registry(targets):
    try:
        HookRegistry.register(f"{TARGETS}.double", lambda r, x: r + 1, HookType.AFTER, plugin="p")

        @plugin_hook(f"{TARGETS}.Calc.double", type=HookType.AFTER, plugin="q")
        def plus_two(result, self, x):
            return result + 2

        assert targets.double(1) == 3 and targets.Calc().double(1) == 4
        assert plus_two(0, None, 0) == 2  # the decorator returns the function unchanged
        assert sorted(HookRegistry.default().plugins()) == ["p", "q"]
    finally:
        HookRegistry.clear()
    assert targets.double(1) == 2
