"""The whole run's watchdog: a run that outlives SUITE_LIMIT_S is a hang, not a slow machine.

A test that hangs in Python is failed by pytest-timeout. One stuck in C with the GIL held
(a deadlock inside a library) never returns to the interpreter, so no timeout fires and the
run would sit until CI's own limit, printing nothing. A separate process therefore sends
SIGABRT to pytest after SUITE_LIMIT_S: faulthandler, which pytest enables, prints every
thread's stack from its signal handler (no GIL needed) and the run ends. The servers the
tests launched die with it (they are SIGTERMed when their parent dies).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# The full suite takes ~11 minutes on two cores; CI allows 90 for install and tests together.
SUITE_LIMIT_S = 45 * 60

_WATCHDOG = """
import os, signal, sys, time
pid, limit = int(sys.argv[1]), float(sys.argv[2])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    time.sleep(5)
    if os.getppid() != pid:  # the run ended without stopping its watchdog
        sys.exit()
print(f"\\nthe test run passed its {limit:.0f} s limit: aborting it for its stacks", file=sys.stderr)
os.kill(pid, signal.SIGABRT)
"""

_watchdog: subprocess.Popen | None = None


def pytest_sessionstart(session):
    global _watchdog
    limit = float(os.environ.get("CADENCE_TEST_SUITE_LIMIT_S", SUITE_LIMIT_S))
    _watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(limit)],
        stdin=subprocess.DEVNULL,
    )


def pytest_unconfigure(config):
    if _watchdog is not None and _watchdog.poll() is None:
        _watchdog.send_signal(signal.SIGTERM)
        _watchdog.wait()
