"""ZMQ sockets on an asyncio loop, lean enough for a control plane measured in microseconds.

Receiving does not go through zmq.asyncio's per-message futures: the loop watches the
socket's file descriptor and `Inbox` drains every message available into a handler, in
arrival order. Sending is a plain non-blocking send: queues are unbounded (HWM 0), so a send
never waits on the loop, and flow control is the relay's credits and the requests in flight.

A drain reads first and asks ZMQ_EVENTS only after each message (a wake-up nearly always
has one: asking before the first read costs as much as the read), and learns whether a
payload frame follows from the message itself (`carries_frame`), not from ZMQ_RCVMORE:
every socket option read processes the socket's command queue, several times the cost of
the read itself, and a control round trip crosses two drains.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

from cadence.pipeline import messages

logger = logging.getLogger(__name__)

_MAX_BATCH = 256  # messages handled before the loop gets a turn
_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's enum flags cost a conversion per call
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


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
    """One message, and its inline payload frame if any (a buffer: bytes, numpy array): the
    frame is there exactly when `messages.carries_frame(msg)` says so."""
    data = messages.encode(msg)
    if (frame is not None) != messages.carries_frame(msg):
        raise ValueError(
            f"a {type(msg).__name__} {'without' if frame is None else 'with'} its frame"
        )
    if frame is None:
        sock.send(data, _NOBLOCK)
    else:
        sock.send_multipart([data, frame], _NOBLOCK, copy=False)


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
        # The socket's descriptor is edge-triggered: it fires again only after ZMQ_EVENTS
        # (or a read) has found nothing left, so a drain ends only there, or hands over to
        # the next turn of the loop, which goes on.
        sock = self.sock
        if self._loop is None:  # stopped since this call was scheduled
            return
        for _ in range(_MAX_BATCH):
            try:
                data = sock.recv(_NOBLOCK)
            except zmq.Again:  # woken with nothing to read
                return
            try:
                msg = messages.decode(data)
            except Exception as e:
                while sock.getsockopt(_RCVMORE):  # its frames too: the next read is a message
                    sock.recv(_NOBLOCK)
                logger.error("%s: dropped a message that does not decode: %s", self.name, e)
                continue
            frame = sock.recv(_NOBLOCK) if messages.carries_frame(msg) else None
            try:
                self.handler(msg, frame)
            except Exception:
                logger.exception("%s: handling %s failed", self.name, type(msg).__name__)
            if self._loop is None or not sock.getsockopt(_EVENTS) & _POLLIN:
                return  # stopped by the handler, or nothing left
        if self._loop is not None:
            self._loop.call_soon(self._drain)  # more may be waiting: after others had a turn
