"""Custom logit processors, registered by plugins and chosen by name per request.

SGLang's `custom_logit_processor` carries serialized Python code; Cadence never runs code
from a request. A plugin registers a processor under a name in the `cadence.logit_processors`
entry-point group; a request names it (`custom_logit_processor`, with `custom_params` in its
sampling parameters), and only with --enable-custom-logit-processor.

A processor is `fn(logits, params) -> logits | None`: `logits` is a float32 tensor
[rows, vocab] of the requests that named it (after penalties and bias, before temperature),
`params` their `custom_params` (one dict or None per row); it changes `logits` in place or
returns the new ones. An exception fails only the requests of that call.

Imports nothing heavy: the front checks names without loading any processor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import entry_points

GROUP = "cadence.logit_processors"


@functools.cache
def names() -> frozenset[str]:
    """The names installed plugins register (read from package metadata, nothing loaded)."""
    return frozenset(ep.name for ep in entry_points(group=GROUP))


@functools.cache
def load(name: str) -> Callable:
    """The processor registered as `name` (loaded once per process)."""
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            return ep.load()
    raise KeyError(f"no logit processor is registered as {name!r}")
