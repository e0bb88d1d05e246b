"""Hooks on dotted-path targets: BEFORE, AFTER, AROUND and REPLACE, each attributed to a plugin.

Registering a hook patches the target at once: the attribute on its module or class is
replaced by a wrapper that runs every hook registered on it, and every other module that
holds the old object under some name (`from x import y`) is rebound to the new one.

Invariants:
- One `_Patch` per attribute, however it was spelled (`a.b.C.m` and `a.b:C.m` are one target).
  It keeps the original object, so clearing the hooks restores exactly what was there.
- At most one REPLACE per target; a second is a `PluginError` naming both plugins.
- Only REPLACE accepts a class, and the replacement must subclass the original, so
  isinstance/issubclass checks against the original keep working.
- Generator functions can only be REPLACEd.

Limits: references held elsewhere than in a module's globals (a dict of handlers, a
closure, a bound method taken earlier) keep the old object; hook the named points in
`cadence.hooks` where that matters.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


class PluginError(RuntimeError):
    """A plugin cannot be loaded or its hook cannot be applied; the message names the plugin."""


class HookType(enum.Enum):
    BEFORE = "before"  # fn(*args, **kwargs) -> None | (args, kwargs)
    AFTER = "after"  # fn(result, *args, **kwargs) -> None | new_result
    AROUND = "around"  # fn(original, *args, **kwargs) -> result
    REPLACE = "replace"  # a function (or a subclass, for a class) used instead of the target


@dataclass(frozen=True)
class Hook:
    target: str  # the dotted path as registered
    fn: Callable[..., Any]  # the hook function, or the replacing class
    type: HookType
    plugin: str  # who registered it


# The plugin being loaded, so that hooks it registers are attributed to it.
_loading_plugin: ContextVar[str | None] = ContextVar("cadence_loading_plugin", default=None)


@contextlib.contextmanager
def attributed_to(plugin: str) -> Iterator[None]:
    token = _loading_plugin.set(plugin)
    try:
        yield
    finally:
        _loading_plugin.reset(token)


def resolve_target(target: str) -> tuple[Any, str]:
    """(owner, attribute) of `a.b.C.method` or `a.b:C.method`; the owner is a module or class."""
    if ":" in target:
        module_name, _, qualname = target.partition(":")
        owner: Any = _import(target, module_name)
        parts = qualname.split(".")
    else:
        parts = target.split(".")
        owner = None
        for i in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
            name = ".".join(parts[:i])
            try:
                owner = importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                    continue  # not a module: part of the attribute path
                raise
            parts = parts[i:]
            break
        if owner is None:
            raise PluginError(f"hook target {target!r}: no importable module in it")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise PluginError(f"hook target {target!r}: {owner!r} has no attribute {part!r}")
        owner = getattr(owner, part)
    if not parts[-1] or not hasattr(owner, parts[-1]):
        raise PluginError(
            f"hook target {target!r}: {getattr(owner, '__name__', owner)!r} has no attribute "
            f"{parts[-1]!r}"
        )
    return owner, parts[-1]


def _import(target: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise PluginError(f"hook target {target!r}: no module {module_name!r}") from e


def _rebind(old: Any, new: Any, keep: set[str]) -> None:
    """Points every module-level name bound to `old` at `new` (reaches `from x import y`),
    except in the modules named in `keep`: a plugin's own names for what it hooks stay the
    originals, so a replacement that calls the original by name does not call itself."""
    if old is new:
        return
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or namespace.get("__name__") in keep:
            continue
        for name, value in list(namespace.items()):
            if value is old:
                namespace[name] = new


def _note(exc: BaseException, hook: Hook) -> None:
    exc.add_note(
        f"(raised in or under the {hook.type.name} hook of plugin {hook.plugin!r} on {hook.target})"
    )


class _Patch:
    """Every hook on one attribute, and what the attribute held before the first one."""

    def __init__(self, owner: Any, attr: str):
        self.owner = owner
        self.attr = attr
        self.had_own = attr in vars(owner)
        self.raw = inspect.getattr_static(owner, attr)  # keeps staticmethod/classmethod wrappers
        self.kind = type(self.raw) if isinstance(self.raw, (staticmethod, classmethod)) else None
        self.original = self.raw.__func__ if self.kind else self.raw
        self.installed = self.original
        self.hooks: list[Hook] = []
        self.plugin_modules: set[str] = set()  # modules of the hooks behind `installed`

    def check(self, hook: Hook) -> None:
        original = self.original
        if isinstance(original, type):
            if hook.type is not HookType.REPLACE:
                raise PluginError(
                    f"plugin {hook.plugin!r}: {hook.target} is a class; only REPLACE accepts a class "
                    f"(hook one of its methods instead)"
                )
            if not (isinstance(hook.fn, type) and issubclass(hook.fn, original)):
                raise PluginError(
                    f"plugin {hook.plugin!r}: a class replacing {hook.target} must subclass it, so "
                    f"isinstance checks keep working"
                )
        elif not callable(original):
            raise PluginError(f"plugin {hook.plugin!r}: {hook.target} is not a function or class")
        elif isinstance(hook.fn, type):
            raise PluginError(
                f"plugin {hook.plugin!r}: only a class can be replaced by a class ({hook.target} "
                f"is a function)"
            )
        elif hook.type is not HookType.REPLACE and (
            inspect.isgeneratorfunction(original) or inspect.isasyncgenfunction(original)
        ):
            raise PluginError(
                f"plugin {hook.plugin!r}: {hook.target} is a generator function; only REPLACE "
                f"applies to it"
            )
        elif hook.type is HookType.REPLACE and inspect.iscoroutinefunction(
            original
        ) != inspect.iscoroutinefunction(hook.fn):
            raise PluginError(
                f"plugin {hook.plugin!r}: the replacement of {hook.target} must be "
                f"{'an async' if inspect.iscoroutinefunction(original) else 'a plain'} function, "
                f"like the target"
            )
        if hook.type is HookType.REPLACE:
            for other in self.hooks:
                if other.type is HookType.REPLACE:
                    raise PluginError(
                        f"plugins {other.plugin!r} and {hook.plugin!r} both REPLACE {hook.target}; "
                        f"uninstall one or leave it out of CADENCE_PLUGINS"
                    )

    def apply(self) -> None:
        """Installs the wrapper for the current hooks (or the original when there are none)."""
        new = _build(self.original, self.hooks) if self.hooks else self.original
        if new is self.installed:
            return
        if self.hooks or self.had_own:
            setattr(self.owner, self.attr, self.kind(new) if self.kind else new)
        else:
            delattr(self.owner, self.attr)  # the class inherited it: inherit it again
        hook_modules = {getattr(h.fn, "__module__", None) for h in self.hooks} - {None}
        _rebind(self.installed, new, hook_modules | self.plugin_modules)
        self.installed = new
        self.plugin_modules = hook_modules


def _build(original: Any, hooks: list[Hook]) -> Any:
    replace = next((h for h in hooks if h.type is HookType.REPLACE), None)
    if isinstance(original, type):
        return replace.fn
    befores = [h for h in hooks if h.type is HookType.BEFORE]
    afters = [h for h in hooks if h.type is HookType.AFTER]
    arounds = [h for h in hooks if h.type is HookType.AROUND]
    core = replace.fn if replace is not None else original
    for hook in reversed(arounds):  # the first registered is the outermost
        core = functools.partial(hook.fn, core)
    core_hook = (
        arounds[0] if arounds else replace
    )  # whose code an exception from `core` came through
    make = _async_wrapper if inspect.iscoroutinefunction(original) else _sync_wrapper
    wrapper = make(befores, core, afters, core_hook)
    functools.update_wrapper(wrapper, original)
    wrapper.__cadence_hooks__ = tuple(hooks)
    return wrapper


def _new_call(hook: Hook, returned: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if returned is None:
        return args, kwargs
    if (
        isinstance(returned, tuple)
        and len(returned) == 2
        and isinstance(returned[0], (tuple, list))
        and isinstance(returned[1], dict)
    ):
        return tuple(returned[0]), returned[1]
    raise PluginError(
        f"plugin {hook.plugin!r}: a BEFORE hook on {hook.target} must return None or "
        f"(args, kwargs), got {type(returned).__name__}"
    )


def _sync_wrapper(befores: list[Hook], core: Callable, afters: list[Hook], core_hook: Hook | None):
    def wrapper(*args, **kwargs):
        for hook in befores:
            try:
                returned = hook.fn(*args, **kwargs)
            except Exception as e:
                _note(e, hook)
                raise
            args, kwargs = _new_call(hook, returned, args, kwargs)
        try:
            result = core(*args, **kwargs)
        except Exception as e:
            if core_hook is not None:
                _note(e, core_hook)
            raise
        for hook in afters:
            try:
                returned = hook.fn(result, *args, **kwargs)
            except Exception as e:
                _note(e, hook)
                raise
            if returned is not None:
                result = returned
        return result

    return wrapper


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _async_wrapper(befores: list[Hook], core: Callable, afters: list[Hook], core_hook: Hook | None):
    async def wrapper(*args, **kwargs):
        for hook in befores:
            try:
                returned = await _maybe_await(hook.fn(*args, **kwargs))
            except Exception as e:
                _note(e, hook)
                raise
            args, kwargs = _new_call(hook, returned, args, kwargs)
        try:
            result = await _maybe_await(core(*args, **kwargs))
        except Exception as e:
            if core_hook is not None:
                _note(e, core_hook)
            raise
        for hook in afters:
            try:
                returned = await _maybe_await(hook.fn(result, *args, **kwargs))
            except Exception as e:
                _note(e, hook)
                raise
            if returned is not None:
                result = returned
        return result

    return wrapper


class _DefaultOrInstance:
    """A method that acts on the process-wide registry when called on the class itself, so
    `HookRegistry.register(...)` and `my_registry.register(...)` both work."""

    def __init__(self, fn: Callable):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, cls: type) -> Callable:
        return self.fn.__get__(obj if obj is not None else cls.default(), cls)


class HookRegistry:
    """Hooks by target, each with the plugin that registered it.

    Called on the class (`HookRegistry.register(...)`), a method acts on the process-wide
    registry that `load_plugins()` fills. Register at start-up, from one thread.
    """

    _default: HookRegistry | None = None

    def __init__(self) -> None:
        self._patches: dict[tuple[int, str], _Patch] = {}

    @classmethod
    def default(cls) -> HookRegistry:
        if HookRegistry._default is None:
            HookRegistry._default = HookRegistry()
        return HookRegistry._default

    @_DefaultOrInstance
    def register(
        self,
        target: str,
        fn: Callable[..., Any] | type,
        type: HookType,
        *,
        plugin: str | None = None,
    ) -> Hook:
        """Hooks `fn` onto `target` now. `plugin` defaults to the plugin being loaded."""
        if not isinstance(type, HookType):
            raise PluginError(f"hook type must be a HookType, got {type!r}")
        plugin = plugin or _loading_plugin.get() or getattr(fn, "__module__", None) or "<unknown>"
        hook = Hook(target, fn, type, plugin)
        owner, attr = resolve_target(target)
        key = (id(owner), attr)
        patch = self._patches.get(key) or _Patch(owner, attr)
        patch.check(hook)
        patch.hooks.append(hook)
        try:
            patch.apply()
        except (TypeError, AttributeError) as e:  # e.g. a built-in type's method
            patch.hooks.pop()
            raise PluginError(f"plugin {plugin!r}: cannot patch {target}: {e}") from e
        self._patches[key] = patch
        return hook

    @_DefaultOrInstance
    def hooks(self, target: str | None = None) -> list[Hook]:
        """Registered hooks, in registration order; only those on `target` when given."""
        if target is None:
            return [h for p in self._patches.values() for h in p.hooks]
        owner, attr = resolve_target(target)
        patch = self._patches.get((id(owner), attr))
        return list(patch.hooks) if patch else []

    @_DefaultOrInstance
    def plugins(self) -> dict[str, list[Hook]]:
        """Each plugin's hooks (attribution, for debugging and /server_info-style reports)."""
        found: dict[str, list[Hook]] = {}
        for hook in self.hooks():
            found.setdefault(hook.plugin, []).append(hook)
        return found

    @_DefaultOrInstance
    def clear(self, plugin: str | None = None) -> None:
        """Removes every hook (or one plugin's), restoring the original objects."""
        for key, patch in list(self._patches.items()):
            patch.hooks = [h for h in patch.hooks if plugin is not None and h.plugin != plugin]
            patch.apply()
            if not patch.hooks:
                del self._patches[key]


def plugin_hook(
    target: str, *, type: HookType, registry: HookRegistry | None = None, plugin: str | None = None
) -> Callable:
    """Decorator form of `HookRegistry.register`: registers the function and returns it unchanged."""

    def decorate(fn):
        (registry or HookRegistry.default()).register(target, fn, type, plugin=plugin)
        return fn

    return decorate
