"""`cadence serve --pipeline`: the front process starts the stage processes and owns their
coordinator; a stage that dies is noticed at once and either restarted
(--pipeline-restart-stages, /health back to 200) or ends the server with exit code 1, leaving
no process, socket directory or shared memory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from e2e_server import child_pids, wait_until

from cadence.pipeline.relay.shm import list_segments

pytestmark = pytest.mark.slow


def stage_pids(srv) -> list[int]:
    """The server's stage processes: the children of its front process's forkserver."""
    pids = []
    for child in srv.children():
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"forkserver" in f.read():
                    pids += child_pids(child)
        except OSError:
            continue
    return sorted(pids)


def segments_of(pids) -> list[str]:
    return [n for n in list_segments() if any(n.startswith(f"cadence-relay-{p}-") for p in pids)]


def test_a_killed_stage_is_restarted(pipeline_server):
    srv = pipeline_server
    before = stage_pids(srv)
    assert len(before) == 2, srv.log_tail()
    os.kill(before[1], signal.SIGKILL)
    assert wait_until(lambda: "restarted; the pipeline is healthy" in srv.log_text(), 30), (
        srv.log_tail()
    )
    assert f"pid {before[1]}) was killed by SIGKILL" in srv.log_text()
    assert httpx.get(srv.url + "/health").status_code == 200
    after = stage_pids(srv)
    assert len(after) == 2 and before[0] in after and before[1] not in after
    assert segments_of([before[1]]) == []  # the dead process's pool was swept
    assert srv.proc.poll() is None


def test_a_killed_stage_stops_the_server_non_zero(pipeline_exit_server):
    srv = pipeline_exit_server
    pids = stage_pids(srv)
    assert len(pids) == 2, srv.log_tail()
    start = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    code = srv.wait_exit(30)
    log = srv.log_tail()
    assert code == 1, f"exit code {code} after {time.monotonic() - start:.1f} s\n{log}"
    assert f"pid {pids[0]}) was killed by SIGKILL" in log and "restarting stages is off" in log
    assert srv.socket_dirs() == []
    assert wait_until(lambda: not srv.leftover_pids(), 5), srv.leftover_pids()
    assert segments_of([srv.proc.pid, *pids]) == []


def test_an_unknown_pipeline_is_refused_before_anything_starts():
    done = subprocess.run(
        [sys.executable, "-m", "cadence.launch_server", "--pipeline", "no-such-pipeline"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "no shipped pipeline of that name" in done.stderr
