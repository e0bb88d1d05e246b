"""Hardware platforms, discovered through the `cadence.platforms` entry-point group.

An entry point names an `activate()` function returning the dotted path of a `Platform`
(= `SRTPlatform`, interface.py) subclass, or None when its hardware is absent. The built-in `cpu` and `cuda` platforms are
registered the same way by Cadence's own pyproject.toml.

`current_platform` is resolved on first use, never at import time:
- CADENCE_PLATFORM set: only that entry point is activated; an unknown name, or an
  activate() that returns None, is a `PlatformError`. Never a silent fallback.
- unset: every out-of-tree platform is activated; exactly one active → it; several →
  `PlatformError` asking to set CADENCE_PLATFORM; none → cuda when available, else cpu.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import traceback
from importlib.metadata import EntryPoint, entry_points

from cadence import envs
from cadence.platforms.interface import (
    ACTIVE_METHODS,
    CpuArchEnum,
    DeviceCapability,
    DeviceMixin,
    Platform,
    PlatformEnum,
    SRTPlatform,
)

__all__ = [
    "ACTIVE_METHODS",
    "CpuArchEnum",
    "DeviceCapability",
    "DeviceMixin",
    "Platform",
    "PlatformEnum",
    "SRTPlatform",
    "PlatformError",
    "current_platform",
    "get_current_platform",
    "resolve_platform",
    "resolved_at",
    "reset_current_platform",
    "PLATFORM_GROUP",
]

logger = logging.getLogger(__name__)

PLATFORM_GROUP = "cadence.platforms"
BUILTIN_PREFERENCE = ("cuda", "cpu")  # the best built-in first


class PlatformError(RuntimeError):
    """No platform can be used as configured; the message says what to change."""


def _entry_points() -> list[EntryPoint]:
    return list(entry_points(group=PLATFORM_GROUP))


def _is_builtin(ep: EntryPoint) -> bool:
    return ep.value.startswith("cadence.platforms.")


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value} from {dist.name}" if dist is not None else ep.value


def _by_name(eps: list[EntryPoint]) -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in eps:
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise PlatformError(
                f"two installed packages register the platform {ep.name!r} ({_origin(other)}; "
                f"{_origin(ep)}); uninstall one of them"
            )
        found[ep.name] = ep
    return found


def _activate(ep: EntryPoint) -> str | None:
    try:
        path = ep.load()()
    except Exception as e:
        raise PlatformError(
            f"platform plugin {ep.name!r} ({_origin(ep)}) failed to activate: {e}"
        ) from e
    if path is not None and not isinstance(path, str):
        raise PlatformError(
            f"platform plugin {ep.name!r}: activate() must return a dotted class path or None, "
            f"got {path!r}"
        )
    return path


def _instantiate(ep: EntryPoint, path: str) -> Platform:
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise PlatformError(
            f"platform {ep.name!r}: cannot import {path!r} named by its activate(): {e}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformError(
            f"platform {ep.name!r}: {path!r} is not a subclass of cadence.platforms.Platform"
        )
    platform = cls()
    if not _is_builtin(ep):  # where it was registered decides, whatever its class says
        platform._enum = PlatformEnum.OOT
    return platform


def resolve_platform() -> Platform:
    """Applies the resolution rules once, without caching; `current_platform` caches."""
    eps = _by_name(_entry_points())
    chosen = envs.platform_name()
    if chosen is not None:
        ep = eps.get(chosen)
        if ep is None:
            raise PlatformError(
                f"CADENCE_PLATFORM={chosen!r} names no installed platform (installed: "
                f"{', '.join(sorted(eps)) or 'none'}); install its plugin or change CADENCE_PLATFORM"
            )
        path = _activate(ep)
        if path is None:
            raise PlatformError(
                f"platform {chosen!r} chosen by CADENCE_PLATFORM is not available here: its "
                f"activate() returned None (is its hardware or driver missing?)"
            )
        return _instantiate(ep, path)
    external = [ep for _, ep in sorted(eps.items()) if not _is_builtin(ep)]
    active = [(ep, path) for ep in external if (path := _activate(ep)) is not None]
    if len(active) > 1:
        names = ", ".join(ep.name for ep, _ in active)
        raise PlatformError(
            f"several platform plugins are active ({names}); set CADENCE_PLATFORM to the one to use"
        )
    if active:
        return _instantiate(*active[0])
    for name in BUILTIN_PREFERENCE:
        ep = eps.get(name)
        if ep is not None and _is_builtin(ep) and (path := _activate(ep)) is not None:
            return _instantiate(ep, path)
    raise PlatformError(
        "no platform is registered: Cadence's own entry points are missing; "
        "reinstall it (pip install -e .)"
    )


_lock = threading.Lock()
_current: Platform | None = None
_resolved_at: str | None = None


def get_current_platform() -> Platform:
    """This process's platform, resolved on the first call."""
    global _current, _resolved_at
    if _current is None:
        with _lock:
            if _current is None:
                platform = resolve_platform()
                # Where the first use happened, for "why is it this platform?" debugging.
                _resolved_at = "".join(traceback.format_stack(limit=8)[:-1])
                _current = platform
                logger.info(
                    "platform: %s (%s)%s",
                    platform.name,
                    platform.get_device_name(),
                    " [out of tree]" if platform.is_out_of_tree() else "",
                )
    return _current


def select_platform(name: str) -> None:
    """--device: `name` becomes this process's platform (and, through CADENCE_PLATFORM, that
    of every process it starts). PlatformError when it names no installed platform, when its
    hardware is absent, when CADENCE_PLATFORM names another, or when this process already
    runs on another (an in-process Engine after the first)."""
    if _current is not None:
        if _current.name != name:
            raise PlatformError(
                f"device {name!r}: this process already runs on the {_current.name!r} "
                "platform; an in-process Engine cannot change it"
            )
        return
    chosen = envs.platform_name()
    if chosen is not None and chosen != name:
        raise PlatformError(
            f"device {name!r} contradicts CADENCE_PLATFORM={chosen!r}: give one of them"
        )
    eps = _by_name(_entry_points())
    if name not in eps:
        raise PlatformError(
            f"device {name!r} names no installed platform (installed: "
            f"{', '.join(sorted(eps)) or 'none'})"
        )
    if _activate(eps[name]) is None:
        raise PlatformError(
            f"device {name!r} is not available here (is its hardware or driver missing?)"
        )
    os.environ[envs.PLATFORM_ENV] = name


def resolved_at() -> str | None:
    """The stack of the call that first resolved the platform in this process, or None."""
    return _resolved_at


def reset_current_platform() -> None:
    """Forgets the resolved platform so the next use resolves again (tests)."""
    global _current, _resolved_at
    with _lock:
        _current, _resolved_at = None, None


class _CurrentPlatform:
    """Stands for this process's platform and resolves it on first attribute access, so
    `from cadence.platforms import current_platform` never resolves at import time."""

    __slots__ = ()

    def __getattr__(self, name: str):
        return getattr(get_current_platform(), name)

    def __repr__(self) -> str:
        return repr(_current) if _current is not None else "<current_platform, not resolved yet>"


current_platform = _CurrentPlatform()
