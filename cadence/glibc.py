"""A function of glibc's, looked up once per call site, where the C library is glibc: the
malloc controls (`mallopt`, `malloc_trim`) that the front and the CPU platform use to hand
freed memory back and to keep loading out of the heap."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable


def function(name: str, *argtypes) -> Callable[..., int] | None:
    """glibc's `name` with `argtypes`, or None where the C library is not glibc (or has no
    such function)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        found = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    found.argtypes = list(argtypes)
    return found
