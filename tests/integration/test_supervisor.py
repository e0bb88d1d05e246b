"""The supervisor with real spawned children: ready reports, deaths and stalls reported once
and at once, restarts within a budget, and stops in rank order that leave nothing behind."""

from __future__ import annotations

import threading
import time

import pytest
import supervisor_children as kids

from cadence.ipc import Heartbeat
from cadence.supervisor import ChildFailed, Failure, ProcessSpec, Supervisor

pytestmark = pytest.mark.timeout(120)


def collector():
    got: list[Failure] = []
    event = threading.Event()

    def on(failure: Failure) -> None:
        got.append(failure)
        event.set()

    return got, event, on


def test_a_ready_report_arrives_and_a_death_before_it_names_the_child():
    with Supervisor() as sup:
        sup.start(
            ProcessSpec(
                "scheduler", kids.reports, ({"status": "ready", "n": 3},), reports_ready=True
            )
        )
        assert sup.wait_ready("scheduler", timeout_s=60) == {"status": "ready", "n": 3}
    with Supervisor() as sup:
        sup.start(ProcessSpec("scheduler", kids.dies_before_reporting, reports_ready=True))
        with pytest.raises(ChildFailed, match="scheduler process died during start-up"):
            sup.wait_ready("scheduler", timeout_s=60)


def test_a_death_is_reported_once_and_at_once():
    got, event, on = collector()
    with Supervisor() as sup:
        sup.start(ProcessSpec("detokenizer", kids.exits, (7,)))
        sup.start(ProcessSpec("scheduler", kids.sleeper))
        t0 = time.monotonic()
        sup.watch(on)
        assert event.wait(10)
        assert time.monotonic() - t0 < 2
        time.sleep(0.5)
    assert [(f.name, f.exitcode) for f in got] == [("detokenizer", 7)]
    assert "detokenizer process died (exited with code 7)" in got[0].reason


def test_a_stalled_heartbeat_is_a_failure():
    import multiprocessing as mp

    shared = mp.get_context("spawn").RawArray("d", 1)
    beat = Heartbeat(shared, 0)
    beat.beat()
    got, event, on = collector()
    with Supervisor(watchdog_timeout_s=0.5) as sup:
        sup.start(ProcessSpec("scheduler", kids.beats, (beat, 1.0), heartbeat=beat))
        sup.watch(on)
        assert event.wait(15)
    assert got[0].name == "scheduler" and got[0].stalled_s > 0.5
    assert "made no progress" in got[0].reason


def test_restarts_stay_within_the_budget():
    restarts, failures = [], []
    done = threading.Event()
    with Supervisor(max_restarts=2) as sup:
        spec = ProcessSpec("stage a", kids.exits, (1,), restart=True)

        def on_restart(f: Failure) -> None:
            restarts.append(f)
            sup.start(spec)

        def on_failure(f: Failure) -> None:
            failures.append(f)
            done.set()

        sup.start(spec)
        sup.watch(on_failure, on_restart)
        assert done.wait(30)
    assert len(restarts) == 2 and len(failures) == 1 and failures[0].name == "stage a"


def test_stop_goes_in_rank_order_and_kills_what_ignores_sigterm(tmp_path):
    front, backend = tmp_path / "front", tmp_path / "backend"
    sup = Supervisor()
    stubborn = sup.start(
        ProcessSpec(
            "stubborn",
            kids.ignores_sigterm,
            (str(tmp_path / "stubborn.ready"),),
            stop_rank=2,
            stop_grace_s=0.3,
        )  # fmt: skip
    )
    sup.start(ProcessSpec("backend", kids.records_stop, (str(backend),), stop_rank=1))
    sup.start(ProcessSpec("front", kids.records_stop, (str(front),), stop_rank=0))
    ready = [tmp_path / "stubborn.ready", tmp_path / "front.ready", tmp_path / "backend.ready"]
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in ready):  # every child has installed its handler
        assert time.monotonic() < deadline
        time.sleep(0.05)
    got, _, on = collector()
    sup.watch(on)
    t0 = time.monotonic()
    sup.stop()
    assert time.monotonic() - t0 < 3
    assert float(front.read_text()) <= float(backend.read_text())
    assert stubborn.exitcode == -9
    assert all(c.proc.exitcode is not None for c in sup.children.values())
    assert got == [], "children stopped on purpose are not failures"


def test_a_child_whose_unwinding_hangs_still_ends_after_sigterm(tmp_path):
    """SIGTERM (the supervisor's, or the kernel's when the parent dies) unwinds a child; a
    `finally` that never returns cannot keep it alive past UNWIND_LIMIT_S."""
    from cadence.supervisor import UNWIND_LIMIT_S

    ready = tmp_path / "ready"
    with Supervisor() as sup:
        proc = sup.start(ProcessSpec("stuck", kids.hangs_while_unwinding, (str(ready),)))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.terminate()
        proc.join(UNWIND_LIMIT_S + 10)
        assert proc.exitcode == 0, proc.exitcode  # ended on its own, not killed
        assert UNWIND_LIMIT_S - 0.5 <= time.monotonic() - t0 <= UNWIND_LIMIT_S + 10


def test_a_child_dead_before_the_watch_began_is_reported():
    got, event, on = collector()
    with Supervisor() as sup:
        proc = sup.start(ProcessSpec("early", kids.exits, (5,)))
        proc.join(timeout=30)
        sup.watch(on)
        assert event.wait(5)
    assert [(f.name, f.exitcode) for f in got] == [("early", 5)]
