"""Every environment variable Cadence reads, in one place."""

from __future__ import annotations

import os


def _get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value in (None, "") else value


def cache_dir() -> str:
    """CADENCE_CACHE_DIR: where converted tokenizers are kept (default ~/.cache/cadence)."""
    return os.path.expanduser(_get("CADENCE_CACHE_DIR", "~/.cache/cadence"))


def platform_name() -> str | None:
    """CADENCE_PLATFORM: the platform plugin to activate; unset picks one automatically."""
    return _get("CADENCE_PLATFORM")


def plugin_whitelist() -> list[str] | None:
    """CADENCE_PLUGINS: comma-separated general plugins to load; unset loads all, empty loads none."""
    value = os.environ.get("CADENCE_PLUGINS")
    return None if value is None else [p.strip() for p in value.split(",") if p.strip()]


def num_threads() -> int | None:
    """CADENCE_NUM_THREADS: torch intra-op threads for the model (default: all cores)."""
    value = _get("CADENCE_NUM_THREADS")
    return None if value is None else int(value)
