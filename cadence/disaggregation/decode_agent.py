"""The decode server's transfer agent: claims rooms at prefill servers and receives their
pages, which the scheduler thread writes into the request's pages (the protocol:
`messages.py`; threads and ownership: `agent.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from cadence.disaggregation import messages as m
from cadence.disaggregation.agent import (
    ANSWER_MARGIN_S,
    Arrived,
    Committed,
    Lost,
    Ready,
    TransferAgent,
    endpoint,
)
from cadence.mem_cache.kv_pool import KVPool
from cadence.pipeline.relay import RelayError, create_relay


@dataclass(eq=False)
class _In:
    """A room on the decode side."""

    room: int
    rid: str
    where: str  # the prefill server's bootstrap endpoint
    receiving: int = 0  # chunks being read from the relay
    num_arrived: int = 0  # pages read so far
    done: m.Done | None = None
    timer: asyncio.TimerHandle | None = None
    source: list[torch.Tensor] | None = None  # the prefill pool's layers, when shared
    ready: bool = False  # every page arrived: committing


@dataclass(eq=False)
class _Peer:
    sock: Any
    rooms: set[int] = field(default_factory=set)
    pool: tuple[str, list[torch.Tensor]] | None = None  # its shared pool, mapped


class DecodeAgent(TransferAgent):
    """The decode side: claims rooms at prefill servers and receives their pages."""

    side = "decode"

    def __init__(self, pool: KVPool, backend: str, **timeouts: float):
        super().__init__(pool, backend, **timeouts)
        self.rooms: dict[int, _In] = {}
        self.peers: dict[str, _Peer] = {}
        self._forming: asyncio.Future | None = None  # torch: the group with the prefill server

    def num_rooms(self) -> int:
        return len(self.rooms)

    # -- the scheduler's calls -----------------------------------------------------------

    def claim(self, room: int, rid: str, host: str, port: int, skip_pages: int) -> None:
        """Asks the prefill server at host:port for the room's pages from `skip_pages` on."""
        self._call(self._claim, room, rid, endpoint(host, port), skip_pages)

    def drop(self, room: int, message: str) -> None:
        """The request ended here: the prefill server stops its side."""
        self._call(self._drop, room, message)

    def commit(self, room: int) -> None:
        """Every Arrived chunk of the room is stored: asks the prefill server to confirm
        (`Committed` follows, or `Lost`)."""
        self._call(self._commit, room)

    def store(self, pages: list[int], event: Arrived) -> None:
        """Writes an Arrived chunk into these pages (scheduler thread): copied from the
        prefill server's shared pool, or unpacked from the relay's bytes."""
        if event.source is not None:
            self.pool.copy_pages_from(event.source[0], event.source[1], pages)
        elif event.data is not None:
            self.pool.scatter_pages(pages, event.data)

    # -- inside the loop -----------------------------------------------------------------

    async def _setup(self) -> None:
        if self.backend == "shm":
            self.relay = create_relay(self._relay_context(1, f"pdd{os.getpid()}", None))

    def _claim(self, room: int, rid: str, where: str, skip_pages: int) -> None:
        peer = self.peers.get(where) or self._connect(where)
        peer.rooms.add(room)
        into = self.rooms[room] = _In(room, rid, where)
        into.timer = self.loop.call_later(
            # A live prefill server answers first, with a more telling reason.
            self.bootstrap_timeout + ANSWER_MARGIN_S,
            self._lose,
            room,
            f"the prefill server at {where[6:]} did not take bootstrap_room {room} within "
            f"{self.bootstrap_timeout:g} s (is it running, with that bootstrap port, and did "
            "the request reach it?)",
        )
        claim = m.Claim(
            room=room, rid=rid, skip_pages=skip_pages, layout=self.pool.layout, backend=self.backend
        )
        if self.backend == "torch" and self._forming is None:
            self._forming = self._spawn(self._form_group(where))
        self._spawn(self._send(peer, claim))

    def _connect(self, where: str) -> _Peer:
        sock = self.zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(where)
        peer = self.peers[where] = _Peer(sock)
        self._spawn(self._read(where, peer))
        self._spawn(self._watch(where, monitor))
        return peer

    async def _send(self, peer: _Peer, msg: m.Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await peer.sock.send(m.encode(msg))

    def _drop(self, room: int, message: str) -> None:
        into = self._forget(room)
        if into is not None:
            self._spawn(self._send(self.peers[into.where], m.Cancel(room=room, message=message)))

    def _forget(self, room: int) -> _In | None:
        into = self.rooms.pop(room, None)
        if into is None:
            return None
        if into.timer is not None:
            into.timer.cancel()
        self.peers[into.where].rooms.discard(room)
        if self.relay is not None:
            self.relay.cleanup(f"room-{room}")
        return into

    def _lose(self, room: int, message: str) -> None:
        if self._forget(room) is not None:
            self._emit(Lost(room, message))

    async def _watch(self, where: str, monitor) -> None:
        """A dropped connection to a prefill server ends the rooms claimed there."""
        from zmq.utils.monitor import recv_monitor_message

        while True:
            event = await recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for room in list(self.peers[where].rooms):
                    self._lose(room, f"the prefill server at {where[6:]} went away")

    async def _read(self, where: str, peer: _Peer) -> None:
        while True:
            self._dispatch(peer, await peer.sock.recv())

    def _message_failed(self, msg: m.Message) -> None:
        self._lose(msg.room, "this server failed to handle the prefill server's message")

    def _on_message(self, peer: _Peer, msg: m.Message) -> None:
        into = self.rooms.get(msg.room)
        if isinstance(msg, m.Chunk):
            if into is not None:
                into.receiving += 1  # now: the Done behind it must wait for it
            self._spawn(self._receive(peer, into, msg))
        elif into is None:
            return  # a room this side dropped: Ping, Done, Failed go nowhere
        elif isinstance(msg, m.Accepted):
            self._rearm(into)
            if msg.pool is not None:
                into.source = self._map_pool(peer, msg.pool)
        elif isinstance(msg, m.Confirmed):
            if into.ready and into.done is not None:
                self._forget(into.room)
                self._emit(Committed(into.room, into.done))
        elif isinstance(msg, m.Done):
            into.done = msg
            self._maybe_ready(peer, into)
        elif isinstance(msg, m.Failed):
            self._lose(into.room, msg.message)

    def _rearm(self, into: _In) -> None:
        if into.timer is not None:
            into.timer.cancel()
        into.timer = self.loop.call_later(
            self.waiting_timeout,
            self._lose,
            into.room,
            f"the KV pages of bootstrap_room {into.room} did not arrive within "
            f"{self.waiting_timeout:g} s",
        )

    def _map_pool(self, peer: _Peer, info: dict[str, Any]) -> list[torch.Tensor]:
        """The prefill server's KV pool, mapped once per segment (a restarted server has a
        new one): one [2, heads, pages, page_size, head_dim] view per layer."""
        from cadence.pipeline.relay.shm import SHM_DIR

        name = info["segment"]
        if peer.pool is not None and peer.pool[0] == name:
            return peer.pool[1]
        # Mapped with every page populated now, once per prefill server: a page first
        # touched inside a copy costs a fault each 4 KiB (a third of a transfer's time).
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, size, flags=flags) if size else None
        finally:
            os.close(fd)
        if mapping is None:
            raise RuntimeError(f"the prefill server's KV pool {name} is empty")
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        own = self.pool.kv_buffer[0]
        shape = (*own.shape[:2], int(info["num_pages"]), *own.shape[3:])
        per_layer = own[:, :, :1].numel() * own.element_size() * shape[2]
        if len(self.pool.kv_buffer) * per_layer > size:
            raise RuntimeError(f"the prefill server's KV pool {name} is smaller than announced")
        layers = [
            flat[i * per_layer : (i + 1) * per_layer].view(own.dtype).view(shape)
            for i in range(len(self.pool.kv_buffer))
        ]
        peer.pool = (name, layers)  # the old mapping goes with its last view
        return layers

    def _commit(self, room: int) -> None:
        into = self.rooms.get(room)
        if into is not None and into.ready:
            self._spawn(self._send(self.peers[into.where], m.DoneAck(room=room)))

    async def _receive(self, peer: _Peer, into: _In | None, chunk: m.Chunk) -> None:
        if chunk.pages is not None:  # in the prefill server's shared pool
            if into is not None:
                into.receiving -= 1
                if self.rooms.get(chunk.room) is into and into.source is not None:
                    into.num_arrived += chunk.num_pages
                    source = (into.source, chunk.pages)
                    self._emit(
                        Arrived(chunk.room, chunk.first_page, chunk.num_pages, None, None, source)
                    )
                self._maybe_ready(peer, into)
            return
        meta, relay = chunk.relay, self.relay
        if relay is None:
            relay = await self._pair_relay(into)
        ack = self._acker(peer, meta)
        if into is None or self.rooms.get(chunk.room) is not into:
            await relay.discard_async(meta, f"room-{chunk.room}", 0)  # nobody wants it
            ack()
            if into is not None:
                into.receiving -= 1
            return
        try:
            data = relay.lend(meta, lambda: self._call(ack))
            release = None
            if data is None:
                data = torch.empty(meta["size"], dtype=torch.uint8)
                op = await relay.get_async(meta, data, f"room-{chunk.room}")
                await op.wait_for_completion(self.waiting_timeout)
                release = ack
            into.num_arrived += chunk.num_pages
            self._emit(Arrived(chunk.room, chunk.first_page, chunk.num_pages, data, release))
        except Exception as e:  # the room fails; the agent goes on
            ack()
            self._lose(chunk.room, f"receiving the KV pages of bootstrap_room {chunk.room}: {e}")
        finally:
            into.receiving -= 1
        self._maybe_ready(peer, into)

    def _acker(self, peer: _Peer, meta: dict[str, Any]) -> Callable[[], None]:
        def ack() -> None:
            if self.relay is not None and self.relay.needs_ack:
                self._spawn(self._send(peer, m.ChunkAck(room=0, relay=meta)))

        return ack

    async def _form_group(self, where: str) -> None:
        """torch: joins the prefill server's process group (its store listens on the port
        after its bootstrap port), when the first claim goes there. The group is fixed for
        both servers' lives: one prefill server and one decode server."""
        host, _, port = where[len("tcp://") :].rpartition(":")
        store = f"{host.strip('[]')}:{int(port) + 1}"
        ctx = self._relay_context(1, f"pdd{os.getpid()}", store)
        self.relay = await self.loop.run_in_executor(None, create_relay, ctx)

    async def _pair_relay(self, into: _In | None) -> Any:
        """The relay to read a chunk with: torch's group, once it has formed."""
        if self._forming is None:
            raise RelayError("a chunk came before this server claimed any room")
        await asyncio.shield(self._forming)
        return self.relay

    def _maybe_ready(self, peer: _Peer, into: _In) -> None:
        if (
            into.done is None
            or into.receiving
            or into.ready
            or self.rooms.get(into.room) is not into
        ):
            return
        if into.num_arrived != into.done.num_pages:
            why = (
                f"bootstrap_room {into.room}: {into.num_arrived} KV pages arrived of the "
                f"{into.done.num_pages} the prefill server sent"
            )
            return self._lose(into.room, why)
        into.ready = True  # the scheduler stores what arrived, then commits
        self._emit(Ready(into.room, into.done))
