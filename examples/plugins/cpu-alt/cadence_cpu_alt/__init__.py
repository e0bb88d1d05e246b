"""An out-of-tree Cadence platform. Only `activate()` lives here, so probing for the
hardware stays cheap: the platform class is imported once it has been chosen."""

from __future__ import annotations


def activate() -> str | None:
    """The platform class when its hardware is present, else None. A real plugin probes its
    device or driver here; every CPU can run this one."""
    return "cadence_cpu_alt.platform.CpuAltPlatform"
