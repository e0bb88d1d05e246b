"""Handing the memory a large request freed back to the system.

glibc keeps freed memory in its heaps (one per thread that allocated, and the main one)
for reuse instead of returning it: a front that tokenized one 30 MB text went to 6.6 GB and
kept 4.0 GB for good. `malloc_trim` returns the free pages of every heap. It is not free
itself: it holds each heap's lock while it walks it (milliseconds, up to a few hundred on a
large fragmented heap), and the event loop's own allocations wait on the main heap's lock
meanwhile. So it runs only after large work, off the event loop, at most once a second.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable
from concurrent.futures import Executor

from cadence import glibc

# Seconds between large work and the release: by then the request's answer is usually
# sent and everything it held freed; the large requests of that second share one release.
RELEASE_DELAY_S = 1.0


def _malloc_trim() -> Callable[[], object] | None:
    trim = glibc.function("malloc_trim", ctypes.c_size_t)
    if trim is None:
        return None
    return lambda: trim(0)  # a ctypes call: the GIL is released while it runs


_TRIM = _malloc_trim()


def release_memory() -> bool:
    """Hands every heap's free pages back to the system (glibc's malloc_trim). False where
    the C library is not glibc (nothing is done)."""
    if _TRIM is None:
        return False
    _TRIM()
    return True


class HeapReleaser:
    """Calls `release_memory` on `executor` RELEASE_DELAY_S after the first `note()` since
    the last release. Use from one event loop's thread."""

    def __init__(self, executor: Executor, delay_s: float = RELEASE_DELAY_S):
        self.executor = executor
        self.delay_s = delay_s
        self.is_pending = False
        self.num_releases = 0

    def note(self) -> None:
        """Large work just ended: release what it freed soon."""
        if self.is_pending or _TRIM is None:
            return
        self.is_pending = True
        asyncio.get_running_loop().call_later(self.delay_s, self._release)

    def _release(self) -> None:
        self.is_pending = False
        self.num_releases += 1
        self.executor.submit(release_memory)
