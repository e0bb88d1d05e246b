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
    def create(cls) -> "IpcPaths":
        directory = tempfile.mkdtemp(prefix="cadence-ipc-")
        os.chmod(directory, 0o700)
        return cls(directory, f"ipc://{directory}/scheduler", f"ipc://{directory}/detokenizer")

    def front_address(self, index: int = 0) -> str:
        """Where front process `index` receives its outputs (its `http_worker_ipc`)."""
        return f"ipc://{self.directory}/front-{index}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


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
