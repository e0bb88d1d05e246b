"""Chat templates shipped with Cadence, for models whose own template lacks something.

`smollm2_tools.jinja`: the default model (SmolLM2) with OpenAI tools in the Hermes format.
Serve it with `--chat-template "$(python -m cadence.chat_templates smollm2_tools)"`.
"""

from __future__ import annotations

import os

_DIR = os.path.dirname(os.path.abspath(__file__))


def names() -> list[str]:
    return sorted(f.removesuffix(".jinja") for f in os.listdir(_DIR) if f.endswith(".jinja"))


def template_path(name: str) -> str:
    """The file of the shipped template `name` (e.g. "smollm2_tools")."""
    path = os.path.join(_DIR, f"{name}.jinja")
    if not os.path.isfile(path):
        raise ValueError(f"no shipped chat template {name!r}; there are {', '.join(names())}")
    return path
