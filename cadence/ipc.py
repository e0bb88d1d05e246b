"""ZMQ plumbing shared by the three processes: a private socket directory and typed sockets.

Every message is a msgspec struct from `io_struct`, encoded with its one codec: no pickle
crosses a socket, so a socket is never a way to run code.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass

import zmq

from cadence import io_struct


@dataclass(frozen=True)
class IpcPaths:
    """Addresses of the sockets that tie one server's processes together."""

    directory: str  # private (0700) directory holding every socket file
    scheduler_input: str  # fronts PUSH requests, the scheduler PULLs
    detokenizer_input: str  # the scheduler PUSHes token ids, the detokenizer PULLs

    @classmethod
    def create(cls) -> IpcPaths:
        """A fresh private directory, named after this process (`cadence-ipc-<pid>-...`) so
        that the next server can sweep it if this one is killed without cleaning up."""
        sweep_dead()
        directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
        os.chmod(directory, 0o700)
        return cls(directory, f"ipc://{directory}/scheduler", f"ipc://{directory}/detokenizer")

    def front_address(self, index: int = 0) -> str:
        """Where front process `index` receives its outputs (its `http_worker_ipc`)."""
        return f"ipc://{self.directory}/front-{index}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


_PREFIX = "cadence-ipc-"


def sweep_dead(root: str | None = None) -> list[str]:
    """Removes the socket directories (ours: same owner) of servers whose process is gone,
    e.g. after a SIGKILL; returns what it removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        pid = name[len(_PREFIX) :].split("-", 1)[0]
        if not name.startswith(_PREFIX) or not pid.isdigit():
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or _is_alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process with that pid: not ours to judge
    return True


class Heartbeat:
    """When a child process last made progress, in shared memory the front process reads.

    One float per child (CLOCK_MONOTONIC seconds, the same clock in every process): the
    child's loop calls `beat()` every iteration (at least once a second, idle or not), and
    `busy(seconds)` before a long operation that legitimately stops the loop (loading new
    weights). The front's watchdog declares the child stuck when the time is older than
    --watchdog-timeout."""

    def __init__(self, shared, index: int):
        self.shared = shared  # a multiprocessing RawArray("d") made by the front process
        self.index = index

    def beat(self) -> None:
        self.shared[self.index] = time.monotonic()

    def busy(self, seconds: float) -> None:
        self.shared[self.index] = time.monotonic() + seconds

    def age(self) -> float:
        """Seconds since the last beat (negative while declared busy; 0 before the first)."""
        last = self.shared[self.index]
        return time.monotonic() - last if last else 0.0


def bind(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def connect(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


class FrontRouter:
    """PUSH sockets to front processes, opened on first use, keyed by `http_worker_ipc`."""

    def __init__(self, ctx: zmq.Context):
        self.ctx = ctx
        self.sockets: dict[str, zmq.Socket] = {}

    def send(self, address: str | None, msg) -> None:
        if address is None:
            return
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.sockets[address] = connect(self.ctx, zmq.PUSH, address)
        sock.send(io_struct.encode(msg), copy=False)


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies: no orphans, even after a
    SIGKILL of the server (Linux only; elsewhere the parent-pid check in the loops covers it)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass
