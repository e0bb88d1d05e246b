"""The whole run's watchdog: a run that outlives SUITE_LIMIT_S is a hang, not a slow machine.

A test that hangs in Python is failed by pytest-timeout. One stuck in C with the GIL held
(a deadlock inside a library) never returns to the interpreter, so no timeout fires and the
run would sit until CI's own limit, printing nothing. A separate process therefore sends
SIGABRT to pytest after SUITE_LIMIT_S: faulthandler, which pytest enables, prints every
thread's stack from its signal handler (no GIL needed) and the run ends. The servers the
tests launched die with it (they are SIGTERMed when their parent dies).

The pytest process must not fork() once gRPC is loaded in it: gRPC's fork handlers then run
there and can deadlock it in just that way. A test that forks it (os.fork, a `fork`
multiprocessing context, subprocess with a preexec_fn) fails, with where the fork came from.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import traceback

import pytest

# The full suite takes ~32 minutes on two cores; CI allows 90 for install and tests together.
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
_forks: list[str] = []  # where the pytest process forked with gRPC loaded


def _before_fork() -> None:
    if "grpc" in sys.modules:
        _forks.append("".join(traceback.format_stack(limit=12)[:-1]))


os.register_at_fork(before=_before_fork)


@pytest.fixture(autouse=True)
def _no_fork_with_grpc():
    yield
    if _forks:
        where = _forks[0]
        _forks.clear()
        pytest.fail(f"this test forked the pytest process with gRPC loaded, from:\n{where}")


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
