"""Cadence: an LLM serving runtime.

Heavy modules (torch, transformers) load only when `Engine` is first touched, so the CLI's
`--help` and the router stay light.
"""

from cadence.version import __version__

__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from cadence.engine import Engine

        return Engine
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
