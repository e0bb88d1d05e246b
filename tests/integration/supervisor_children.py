"""Child processes for the supervisor tests (spawned: they must be importable by name)."""

from __future__ import annotations

import os
import signal
import sys
import time


def sleeper(seconds: float = 60.0) -> None:
    time.sleep(seconds)


def exits(code: int) -> None:
    sys.exit(code)


def reports(facts: dict, writer) -> None:
    import msgspec

    writer.send_bytes(msgspec.msgpack.encode(facts))
    time.sleep(60)


def dies_before_reporting(writer) -> None:
    os._exit(3)


def beats(heartbeat, seconds: float) -> None:
    """Beats for `seconds`, then hangs without beating."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        heartbeat.beat()
        time.sleep(0.05)
    time.sleep(60)


def ignores_sigterm(ready: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(ready, "w").close()
    time.sleep(60)


def records_stop(path: str) -> None:
    """Writes the time it was told to stop into `path`, then exits."""

    def stop(*_):
        with open(path, "w") as f:
            f.write(repr(time.monotonic()))
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    open(path + ".ready", "w").close()
    time.sleep(60)


def hangs_while_unwinding(ready: str) -> None:
    """Keeps the supervisor's SIGTERM handling but, once it unwinds, waits forever in a
    `finally` block (what waiting on a peer that died with the parent looks like)."""
    open(ready, "w").close()
    try:
        time.sleep(60)
    finally:
        time.sleep(60)
