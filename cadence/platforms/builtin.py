"""`activate()` functions of the built-in platforms, registered in pyproject.toml under the
`cadence.platforms` entry-point group exactly like a plugin's."""

from __future__ import annotations


def activate_cpu() -> str:
    return "cadence.platforms.cpu.CpuPlatform"


def activate_cuda() -> str | None:
    import torch

    return "cadence.platforms.cuda.CudaPlatform" if torch.cuda.is_available() else None
