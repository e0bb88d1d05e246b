"""General plugins: hooks on Cadence's functions and classes, discovered through the
`cadence.plugins` entry-point group and loaded by `load_plugins()` in every process.

An entry point names a `register()` function that calls `HookRegistry.register(target, fn,
HookType.X)` or uses `@plugin_hook(target, type=HookType.X)`. Prefer the named hook points
in `cadence.hooks`; dotted paths reach internals that may change. See docs/plugins.md.

Imports nothing heavy: the router loads plugins too.
"""

from cadence.plugins.loader import PLUGIN_GROUP, load_plugins
from cadence.plugins.registry import (
    Hook,
    HookRegistry,
    HookType,
    PluginError,
    plugin_hook,
    resolve_target,
)

__all__ = [
    "Hook",
    "HookRegistry",
    "HookType",
    "PLUGIN_GROUP",
    "PluginError",
    "load_plugins",
    "plugin_hook",
    "resolve_target",
]
