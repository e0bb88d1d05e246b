"""The one owner of child processes: how each is started, reports ready, is watched for death
and for stalls, restarted or not, and stopped in order.

Every process Cadence starts goes through a `Supervisor`: the server's scheduler and
detokenizer, the front workers of `--api-workers`, a pipeline's stage processes (and the
parallel ranks to come). An owner describes each child as a `ProcessSpec` and hands over
what happens on a failure; the supervisor does the rest:

- start: spawn (never fork: the parent holds threads, gRPC and ZMQ), each child dying with
  its parent (PR_SET_PDEATHSIG, and a parent-pid check for a parent already gone);
- ready: a child whose spec says `reports_ready` gets the write end of a pipe as its last
  argument and sends one msgpack report through it; `wait_ready` waits for it while
  watching the child, so a death during start-up is an error naming the child at once;
- watch: one thread wakes on any child's exit (its sentinel) and, for a child with a
  heartbeat, on a heartbeat older than the watchdog's patience; a restartable child within
  its restart budget goes to the owner's `on_restart`, every other failure to `on_failure`;
- stop: children stop in `stop_rank` order (fronts before the scheduler they talk to),
  each rank together: SIGTERM, a grace period, SIGKILL; every child is reaped.

Threads only call the owner's callbacks; an owner living on an event loop passes callbacks
that hop onto it (`loop.call_soon_threadsafe`). Standard library only, plus the liveness
helpers: the CLI imports this module before anything heavy.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("cadence.supervisor")


class ChildFailed(RuntimeError):
    """A child died (or stopped making progress) where the owner cannot go on without it."""


@dataclass(frozen=True)
class ProcessSpec:
    """One child process, as its owner describes it."""

    name: str  # how logs and errors name it ("scheduler", "front 1", "stage thinker")
    # Its entry point: a module-level function, or "module:function", imported in the child
    # only (so that the parent never imports what only the child needs, such as torch).
    target: Callable[..., Any] | str
    args: tuple = ()
    # Receives a pipe's write end as its last argument and sends one report through it.
    reports_ready: bool = False
    heartbeat: Any = None  # a `cadence.ipc.Heartbeat` it beats while it makes progress
    restart: bool = False  # a death goes to the owner's on_restart (within the budget)
    stop_rank: int = 0  # lower ranks stop first
    stop_grace_s: float = 3.0  # after SIGTERM, before SIGKILL


@dataclass
class Failure:
    """Why a child is lost: it died (`exitcode` set) or stalled (`stalled_s` set)."""

    name: str
    pid: int | None
    exitcode: int | None = None
    stalled_s: float | None = None

    @property
    def reason(self) -> str:
        if self.stalled_s is not None:
            return f"the {self.name} process made no progress for {self.stalled_s:.1f} s"
        return f"the {self.name} process died ({exit_text(self.exitcode)})"


@dataclass
class _Child:
    spec: ProcessSpec
    proc: Any  # multiprocessing.Process
    ready: Any = None  # the read end of its ready pipe
    deaths: list[float] = field(default_factory=list)


def child_start(parent_pid: int) -> None:
    """First thing in a child: die with the parent, even if it is already gone (a child of
    a forkserver has the forkserver as its parent, so the owner's pid is asked directly)."""
    from cadence.liveness import die_with_parent, is_alive

    die_with_parent()
    if os.getppid() != parent_pid and not is_alive(parent_pid):
        os._exit(0)


def _entry(parent_pid: int, target: Callable[..., Any] | str, args: tuple) -> None:
    child_start(parent_pid)
    # SIGTERM unwinds the child like an exception: its `finally` blocks run, then it ends
    # at once (see exit_fast).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    code = 0
    try:
        if isinstance(target, str):
            import importlib

            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        assert callable(target)
        target(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    exit_fast(code)


UNWIND_LIMIT_S = 5.0  # after SIGTERM, how long a child's unwinding may take before it just ends


def _exit_on_sigterm(signum, frame) -> None:
    # Unwinding runs `finally` blocks and finalizers, any of which could wait on something
    # that died with the parent (a peer's socket, a thread): it is given a bounded time, so
    # that a child asked to stop (or orphaned) always ends.
    limit = threading.Timer(UNWIND_LIMIT_S, os._exit, args=(0,))
    limit.daemon = True
    limit.start()
    raise SystemExit(0)


def exit_fast(code: int) -> None:
    """Ends this process without the interpreter's teardown, which in a process that
    imported torch spends seconds collecting every module's objects. Multiprocessing's
    finalizers still run (a lock it made is released, not reported as leaked by the
    resource tracker), and logs and streams are flushed."""
    import sys

    try:
        multiprocessing.util._run_finalizers()  # type: ignore[attr-defined]  # private, the only way
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Supervisor:
    """Starts, watches and stops the children of one owner (see the module docstring)."""

    def __init__(
        self,
        watchdog_timeout_s: float | None = None,
        max_restarts: int = 3,
        restart_window_s: float = 300.0,
        start_method: str = "spawn",
    ):
        self.ctx: Any = mp.get_context(start_method)
        self.watchdog_timeout_s = watchdog_timeout_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.children: dict[str, _Child] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._on_failure: Callable[[Failure], None] | None = None
        self._on_restart: Callable[[Failure], None] | None = None
        self._reported: set[int] = set()  # pids whose failure was handed over

    # ---- start --------------------------------------------------------------------------

    def start(self, spec: ProcessSpec):
        """Spawns `spec` (replacing a dead child of the same name); returns the process."""
        args = spec.args
        ready = None
        if spec.reports_ready:
            ready, writer = self.ctx.Pipe(duplex=False)
            args = (*args, writer)
        proc = self.ctx.Process(
            target=_entry, args=(os.getpid(), spec.target, args), name=spec.name, daemon=False
        )
        proc.start()
        if spec.reports_ready:
            writer.close()  # the child holds it now; its death then ends our reads
        with self._lock:
            old = self.children.get(spec.name)
            deaths = old.deaths if old is not None else []
            self.children[spec.name] = _Child(spec, proc, ready, deaths)
        return proc

    def wait_ready(
        self, name: str, timeout_s: float = 1800.0, stopping: threading.Event | None = None
    ) -> dict | None:
        """The ready report of child `name` (a dict); None when `stopping` was set first.
        Raises ChildFailed when the child, or any other child, dies first or none comes."""
        import msgspec

        child = self.children[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if stopping is not None and stopping.is_set():
                return None
            try:
                if child.ready.poll(0.2):
                    return msgspec.msgpack.decode(child.ready.recv_bytes())
            except (EOFError, OSError):
                pass  # the child is gone: its exit code tells below
            for other in list(self.children.values()):
                if other.proc.exitcode is not None:
                    raise ChildFailed(
                        f"the {other.spec.name} process died during start-up "
                        f"({exit_text(other.proc.exitcode)})"
                    )
        raise ChildFailed(f"the {name} process did not report ready in {timeout_s:g} s")

    # ---- watch --------------------------------------------------------------------------

    def watch(
        self,
        on_failure: Callable[[Failure], None],
        on_restart: Callable[[Failure], None] | None = None,
    ) -> None:
        """Starts the watch thread: a child that dies or stalls is reported once, to
        `on_restart` when its spec restarts and its budget allows, else to `on_failure`."""
        self._on_failure, self._on_restart = on_failure, on_restart
        self._watcher = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        period = 0.5
        if self.watchdog_timeout_s is not None:
            period = min(period, self.watchdog_timeout_s / 4)
        while not self._stopping.is_set():
            with self._lock:
                children = list(self.children.values())
            live = {c.proc.sentinel: c for c in children if c.proc.exitcode is None}
            for child in children:  # dead before the watch began, or between two waits
                if child.proc.exitcode is not None and child.proc.pid not in self._reported:
                    self._report(
                        child, Failure(child.spec.name, child.proc.pid, child.proc.exitcode)
                    )
            fired = multiprocessing.connection.wait(list(live), timeout=period) if live else []
            if not live:
                self._stopping.wait(period)
            if self._stopping.is_set():
                return
            for sentinel in fired:
                child = live[sentinel]
                child.proc.join(timeout=1)  # the sentinel can fire before the status is readable
                self._report(child, Failure(child.spec.name, child.proc.pid, child.proc.exitcode))
            self._check_heartbeats()

    def _check_heartbeats(self) -> None:
        if self.watchdog_timeout_s is None:
            return
        for child in list(self.children.values()):
            beat = child.spec.heartbeat
            if beat is None or child.proc.exitcode is not None:
                continue
            age = beat.age()
            if age > self.watchdog_timeout_s:
                self._report(child, Failure(child.spec.name, child.proc.pid, stalled_s=age))

    def _report(self, child: _Child, failure: Failure) -> None:
        if child.proc.pid in self._reported or self._stopping.is_set():
            return
        self._reported.add(child.proc.pid)
        if child.spec.restart and self._on_restart is not None and self._may_restart(child):
            logger.warning("%s; restarting it", failure.reason)
            self._on_restart(failure)
        elif self._on_failure is not None:
            self._on_failure(failure)

    def _may_restart(self, child: _Child) -> bool:
        now = time.monotonic()
        child.deaths[:] = [t for t in child.deaths if t > now - self.restart_window_s] + [now]
        return len(child.deaths) <= self.max_restarts

    def restarts_left(self, name: str) -> int:
        now = time.monotonic()
        recent = [t for t in self.children[name].deaths if t > now - self.restart_window_s]
        return max(self.max_restarts - len(recent), 0)

    def forget(self, name: str) -> None:
        """Stops watching child `name` (stopped on purpose, e.g. to restart its group)."""
        with self._lock:
            child = self.children.get(name)
        if child is not None:
            self._reported.add(child.proc.pid)

    def processes(self) -> dict[str, Any]:
        """The current process of each child, by name."""
        with self._lock:
            return {name: child.proc for name, child in self.children.items()}

    # ---- stop ---------------------------------------------------------------------------

    def stop(self, names: list[str] | None = None, patience_s: float = 0.0) -> None:
        """Stops the children `names` (all of them by default) in stop_rank order and reaps
        them; a later failure of theirs is not reported. `patience_s`: how long children
        that were asked to end by other means (a shutdown message) get before any signal.
        Idempotent."""
        if names is None:
            self._stopping.set()
        with self._lock:
            chosen = [c for n, c in self.children.items() if names is None or n in names]
        for child in chosen:
            self._reported.add(child.proc.pid)
        deadline = time.monotonic() + patience_s
        for child in chosen:
            child.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for rank in sorted({c.spec.stop_rank for c in chosen}):
            stop_together([c.proc for c in chosen if c.spec.stop_rank == rank],
                          max(c.spec.stop_grace_s for c in chosen if c.spec.stop_rank == rank))  # fmt: skip
        for child in chosen:
            if child.ready is not None:
                child.ready.close()
                child.ready = None
        if (
            names is None
            and self._watcher is not None
            and self._watcher is not threading.current_thread()
        ):
            self._watcher.join(timeout=2)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_together(procs: list, grace_s: float) -> None:
    """SIGTERM to every live process at once, up to `grace_s` for them all, then SIGKILL;
    every one is reaped."""
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            proc.kill()
            proc.join(timeout=2)


def exit_text(code: int | None) -> str:
    """How a process ended, in words: "exited with code 1", "was killed by SIGKILL"."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
