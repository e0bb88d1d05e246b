"""ZMQ plumbing shared by the three processes: a private socket directory and typed sockets.

Every message is a msgspec struct from `io_struct`, encoded with its one codec: no pickle
crosses a socket, so a socket is never a way to run code.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

import zmq

from cadence import io_struct
from cadence.liveness import make_owned_dir, sweep_owned_dirs


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
        directory = make_owned_dir(_PREFIX)
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
    return sweep_owned_dirs(_PREFIX, root)


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
