"""`load_plugins()`: run every installed general plugin's `register()` once per process."""

from __future__ import annotations

import logging
import os
from importlib.metadata import EntryPoint, entry_points

from cadence import envs
from cadence.plugins.registry import HookRegistry, PluginError, attributed_to

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "cadence.plugins"

_loaded_pid: int | None = None  # the process that loaded them; a forked child differs
_loaded: list[str] = []


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value} from {dist.name} {dist.version}" if dist is not None else ep.value


def _selected() -> list[EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise PluginError(
                f"two installed packages register the plugin {ep.name!r} ({_origin(other)}; "
                f"{_origin(ep)}); uninstall one of them"
            )
        found[ep.name] = ep
    wanted = envs.plugin_whitelist()
    if wanted is None:
        return [found[name] for name in sorted(found)]
    missing = [name for name in wanted if name not in found]
    if missing:
        raise PluginError(
            f"CADENCE_PLUGINS names {', '.join(map(repr, missing))}, which no installed package "
            f"provides (installed: {', '.join(sorted(found)) or 'none'})"
        )
    return [found[name] for name in sorted(set(wanted))]


def load_plugins() -> list[str]:
    """Runs the `register()` of every plugin in the `cadence.plugins` entry-point group (only
    those CADENCE_PLUGINS names, when set), in name order, and returns their names.

    Once per process: later calls return at once. A forked child inherits its parent's
    patches; it undoes them and loads again, so each hook is registered once in it too.
    A plugin that fails is a `PluginError` naming it, after every hook is undone.
    """
    global _loaded_pid, _loaded
    if _loaded_pid == os.getpid():
        return list(_loaded)
    registry = HookRegistry.default()
    if _loaded_pid is not None:
        registry.clear()
    loaded = []
    try:
        for ep in _selected():
            with attributed_to(ep.name):
                try:
                    ep.load()()
                except Exception as e:
                    raise PluginError(
                        f"plugin {ep.name!r} ({_origin(ep)}) failed to load: "
                        f"{type(e).__name__}: {e}"
                    ) from e
            loaded.append(ep.name)
    except PluginError:
        registry.clear()
        raise
    _loaded_pid, _loaded = os.getpid(), loaded
    if loaded:
        logger.info("plugins loaded in process %d: %s", os.getpid(), ", ".join(loaded))
    return list(loaded)
