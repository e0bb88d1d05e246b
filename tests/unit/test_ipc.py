"""The IPC directory's life: named after the server's pid, swept once that pid is gone;
the heartbeat the watchdog reads."""

import multiprocessing
import os
import subprocess
import sys
import time

from cadence.ipc import Heartbeat, IpcPaths, sweep_dead


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_directories_of_dead_servers_are_swept_and_live_ones_kept(tmp_path):
    dead = tmp_path / f"cadence-ipc-{dead_pid()}-abc"
    alive = tmp_path / f"cadence-ipc-{os.getpid()}-def"
    other = tmp_path / "cadence-ipc-notapid"
    unrelated = tmp_path / "something-else"
    for d in (dead, alive, other, unrelated):
        d.mkdir()
        (d / "scheduler").write_text("")
    assert sweep_dead(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and other.exists() and unrelated.exists()


def test_created_directories_carry_the_pid_and_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    paths = IpcPaths.create()
    try:
        name = os.path.basename(paths.directory)
        assert name.startswith(f"cadence-ipc-{os.getpid()}-") and os.path.dirname(
            paths.directory
        ) == str(tmp_path)
        assert os.stat(paths.directory).st_mode & 0o777 == 0o700
    finally:
        paths.remove()


def test_heartbeat_age_busy_and_not_started():
    shared = multiprocessing.get_context("spawn").RawArray("d", 1)
    beat = Heartbeat(shared, 0)
    assert beat.age() == 0.0  # no verdict before the first beat
    beat.beat()
    time.sleep(0.05)
    assert 0.04 < beat.age() < 1.0
    beat.busy(60)
    assert beat.age() < -50


def test_a_zombie_counts_as_dead_and_its_directory_is_swept(tmp_path):
    from cadence.liveness import is_alive

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, not reaped yet
    deadline = time.monotonic() + 10
    while is_alive(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert not is_alive(zombie.pid) and is_alive(os.getpid())
        left = tmp_path / f"cadence-ipc-{zombie.pid}-z"
        left.mkdir()
        assert sweep_dead(str(tmp_path)) == [str(left)]
    finally:
        zombie.wait()
