"""`cadence serve --pipeline`: the front process starts the stage processes and owns their
coordinator; a stage that dies is noticed at once and either restarted
(--pipeline-restart-stages; /health 503 and grpc.health.v1 NOT_SERVING meanwhile, back to
200 and SERVING after) or ends the server with exit code 1, leaving
no process, socket directory or shared memory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from e2e_server import child_pids, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_support import target

from cadence.pipeline.relay.shm import list_segments

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


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
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target(srv)))
    statuses = []  # grpc.health.v1 as seen while the stage is down and restarted
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
    watcher = threading.Thread(target=lambda: _follow(watch, statuses), daemon=True)
    watcher.start()
    assert wait_until(lambda: statuses == [SERVING], 10), statuses
    os.kill(before[1], signal.SIGKILL)
    assert wait_until(lambda: "restarted; the pipeline is healthy" in srv.log_text(), 30), (
        srv.log_tail()
    )
    assert f"pid {before[1]}) was killed by SIGKILL" in srv.log_text()
    assert httpx.get(srv.url + "/health").status_code == 200
    assert wait_until(lambda: statuses[-1:] == [SERVING] and len(statuses) >= 3, 10), (
        statuses,
        srv.log_tail(),
    )
    watch.cancel()
    assert statuses[:3] == [SERVING, NOT_SERVING, SERVING], statuses
    after = stage_pids(srv)
    assert len(after) == 2 and before[0] in after and before[1] not in after
    assert segments_of([before[1]]) == []  # the dead process's pool was swept
    assert srv.proc.poll() is None


def _follow(watch, statuses: list) -> None:
    try:
        for reply in watch:
            statuses.append(reply.status)
    except grpc.RpcError:
        pass  # cancelled at the end of the test


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
