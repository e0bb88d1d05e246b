"""`activate()` functions of the built-in platforms, registered in pyproject.toml under the
`cadence.platforms` entry-point group exactly like a plugin's."""

from __future__ import annotations

import importlib.util
import os
import re


def activate_cpu() -> str:
    return "cadence.platforms.cpu.CpuPlatform"


def activate_cuda() -> str | None:
    if not _torch_built_with_cuda():
        return None  # torch is not even imported: seconds off every process's start
    import torch

    return "cadence.platforms.cuda.CudaPlatform" if torch.cuda.is_available() else None


def _torch_built_with_cuda() -> bool:
    """Whether the installed torch was built with CUDA (`torch.version.cuda` is set), read
    from its version file without importing torch; True when that file cannot be read, so
    that torch itself decides."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False  # no torch: nothing can run on CUDA
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return True
    match = re.search(r"^cuda(?::[^=]*)?=\s*(.+)$", text, re.MULTILINE)
    return match is None or match.group(1).strip() != "None"
