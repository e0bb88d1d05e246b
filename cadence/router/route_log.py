"""The route log: one JSON line per routed request, appended best effort.

A line is written with a single os.write on an O_APPEND descriptor, so lines from
concurrent requests never interleave. A failed write is counted and logged once; it
never fails the request that produced the line.
"""

from __future__ import annotations

import logging
import os

import msgspec

logger = logging.getLogger("cadence.router")

_encoder = msgspec.json.Encoder()


class RouteLog:
    """Appends route records to a file; a no-op when no path is configured."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.num_write_errors = 0
        self._fd: int | None = None
        if path:
            # Failing to open is a configuration error the user should see at startup.
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ValueError(f"route_log: cannot open {path}: {exc.strerror}") from None

    @property
    def is_enabled(self) -> bool:
        return self._fd is not None

    def write(self, record: dict) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, _encoder.encode(record) + b"\n")
        except Exception as exc:  # best effort: nothing here may fail a request
            self.num_write_errors += 1
            if self.num_write_errors == 1:
                logger.warning(
                    "route log %s: write failed (%s); continuing without it", self.path, exc
                )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
