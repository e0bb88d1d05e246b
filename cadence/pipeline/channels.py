"""ZMQ sockets on an asyncio loop, lean enough for a control plane measured in microseconds.

Receiving does not go through zmq.asyncio's per-message futures: the loop watches the
socket's file descriptor and `Inbox` drains every message available into a handler, in
arrival order. Sending is a plain non-blocking send: queues are unbounded (HWM 0), so a send
never waits on the loop, and flow control is the relay's credits and the requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

from cadence.pipeline import messages

logger = logging.getLogger(__name__)

_MAX_BATCH = 256  # messages handled before the loop gets a turn


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
    return sock


def bind(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = _socket(ctx, kind)
    sock.bind(address)
    return sock


def connect(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = _socket(ctx, kind)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg: messages.Message, frame=None) -> None:
    """One message, and its inline payload frame if any (a buffer: bytes, numpy array)."""
    data = messages.encode(msg)
    if frame is None:
        sock.send(data, zmq.NOBLOCK)
    else:
        sock.send_multipart([data, frame], zmq.NOBLOCK, copy=False)


class Inbox:
    """Calls `handler(message, frame_or_None)` for every message a PULL/SUB socket receives.

    A message that does not decode is logged and dropped (a peer speaking another version);
    an exception from the handler is logged and does not stop the inbox."""

    def __init__(self, sock: zmq.Socket, handler: Callable, name: str):
        self.sock = sock
        self.handler = handler
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = sock.getsockopt(zmq.FD)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # what arrived before we watched

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def _drain(self) -> None:
        sock = self.sock
        for _ in range(_MAX_BATCH):
            if self._loop is None or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            try:
                msg = messages.decode(frames[0].buffer)
            except Exception as e:
                logger.error("%s: dropped a message that does not decode: %s", self.name, e)
                continue
            try:
                self.handler(msg, frames[1].buffer if len(frames) > 1 else None)
            except Exception:
                logger.exception("%s: handling %s failed", self.name, type(msg).__name__)
        if self._loop is not None:
            self._loop.call_soon(self._drain)  # more may be waiting: after others had a turn
