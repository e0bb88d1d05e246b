"""KV transfer agents: the thread of a prefill or decode server that moves KV pages.

Each agent runs an asyncio loop on a thread of the scheduler process, with the bootstrap
channel's sockets (`messages.py`) and a pipeline relay (`cadence.pipeline.relay`: shm on one
host, torch across hosts). The scheduler talks to it through a few thread-safe calls (`expect`,
`send`, `finish`, `claim`, `drop`) and reads what happened with `take_events()`; a byte on
`wake_fd` tells its loop that events wait.

Page ownership never crosses threads in a way that can corrupt the pool:
- prefill: the agent reads (gathers) pages the request holds; the scheduler frees them only
  after `Sent` (the decode side has them) or after it dropped the room (what the agent read
  late then goes nowhere: the decode side is told the room failed).
- decode: the agent only receives bytes; the scheduler thread writes them into the request's
  pages (`store`), so an abort can never race a write into pages given to someone else.

Every room has a deadline: a claim must meet its request within the bootstrap timeout, the
transfer must finish within the waiting timeout, and a peer that goes away (its socket drops,
or it stops answering pings) ends its rooms at once. A room always ends in exactly one event
for the scheduler (`Sent`/`Ready` or `Lost`) unless the scheduler dropped it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
import zmq.asyncio

from cadence.disaggregation import messages as m
from cadence.mem_cache.kv_pool import KVPool
from cadence.pipeline.config import RelayConfig
from cadence.pipeline.payload import copy_bytes
from cadence.pipeline.relay import RelayContext, RelayError, create_relay

logger = logging.getLogger("cadence.disaggregation")

CHUNK_BYTES = (4 << 20) - 4096  # a chunk stays under the shm relay's split size: one gather
PING_S = 1.0
ANSWER_MARGIN_S = 1.0  # a decode side's own deadline runs past the prefill side's by this  # how often a prefill server checks that its claimed rooms' decode servers live
CREDITS = 8  # relay slots in flight per prefill server
SLOT_MB = 4.0


# ---- what the scheduler learns -------------------------------------------------------------


@dataclass
class Arrived:
    """Pages [first_page, first_page + num_pages) of a room, as bytes; the scheduler writes
    them into the request's pages (`DecodeAgent.store`), then calls `release`."""

    room: int
    first_page: int
    num_pages: int
    data: torch.Tensor | None
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        self.data = None  # a lent view: dropping it hands the sender's memory back
        release, self._release = self._release, None
        if release is not None:
            release()


@dataclass
class Ready:
    """Every page of the room is here (once the Arrived before it are stored): the request
    goes on with `done.token`."""

    room: int
    done: m.Done


@dataclass
class Sent:
    """The decode side has the room's pages and first token: the prefill request may end."""

    room: int


@dataclass
class Lost:
    """The room ended without its transfer: the request fails with `message`."""

    room: int
    message: str


Event = Arrived | Ready | Sent | Lost


class PagePayload:
    """Pages of a pool as a relay payload (`Relay.put_payload_async`): gathered straight into
    the relay's memory, layer by layer (`KVPool.gather_pages`)."""

    def __init__(self, pool: KVPool, pages: list[int]):
        self.pool, self.pages = pool, pages
        self.nbytes = len(pages) * pool.page_nbytes

    def pack_into(self, dst: torch.Tensor, start: int = 0, end: int | None = None) -> None:
        end = self.nbytes if end is None else end
        if (start, end) == (0, self.nbytes):
            self.pool.gather_pages(self.pages, dst[: self.nbytes])
            return
        whole = torch.empty(self.nbytes, dtype=torch.uint8)  # a part of a split copy
        self.pool.gather_pages(self.pages, whole)
        copy_bytes(dst[start:end], whole[start:end])

    def pack(self, device: str | torch.device = "cpu") -> torch.Tensor:
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.pack_into(buf)
        return buf


# ---- the thread both agents share ----------------------------------------------------------


class TransferAgent:
    """An asyncio loop on its own thread; see the module docstring."""

    side = ""

    def __init__(
        self,
        pool: KVPool,
        backend: str,
        bootstrap_timeout: float,
        waiting_timeout: float,
    ):
        self.pool = pool
        self.backend = backend
        self.bootstrap_timeout = bootstrap_timeout
        self.waiting_timeout = waiting_timeout
        self.pages_per_chunk = max(1, CHUNK_BYTES // pool.page_nbytes)
        self.relay: Any = None
        self.zmq = zmq.asyncio.Context()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"pd-{self.side}", daemon=True)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._stop: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop ended already
                self.loop.call_soon_threadsafe(self._finish_loop)
            self._thread.join(5)
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def take_events(self) -> list[Event]:
        """What happened since the last call, in order (scheduler thread)."""
        with contextlib.suppress(OSError):
            while os.read(self.wake_fd, 4096):
                pass
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    @property
    def has_events(self) -> bool:
        return not self._events.empty()

    def stats(self) -> dict[str, Any]:
        relay = self.relay.stats() if self.relay is not None else {"pending": 0}
        return {"rooms": self.num_rooms(), "relay": relay}

    def num_rooms(self) -> int:
        raise NotImplementedError

    # -- inside the loop -----------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        finally:
            self.loop.close()

    async def _main(self) -> None:
        self._stop = self.loop.create_future()
        try:
            await self._setup()
        except BaseException as e:
            self._start_error = e
            self._started.set()
            self._teardown()
            return
        self._started.set()
        try:
            await self._stop
        finally:
            for task in list(self._tasks):
                task.cancel()
            self._teardown()

    async def _setup(self) -> None:
        raise NotImplementedError

    def _teardown(self) -> None:
        if self.relay is not None:
            with contextlib.suppress(Exception):
                self.relay.close()
        self.zmq.destroy(linger=0)

    def _finish_loop(self) -> None:
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs `fn(*args)` on the loop (from the scheduler thread)."""
        with contextlib.suppress(RuntimeError):  # closed: the server is stopping
            self.loop.call_soon_threadsafe(fn, *args)

    def _spawn(self, coro) -> asyncio.Task:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _emit(self, event: Event) -> None:
        self._events.put(event)
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _relay_context(self, rank: int, pipeline_id: str, store: str | None) -> RelayContext:
        config = RelayConfig(
            backend=self.backend,
            slot_mb=SLOT_MB,
            credits=CREDITS,
            transfer_timeout_s=self.waiting_timeout,
        )
        return RelayContext(pipeline_id, rank, 2, "cpu", config, store_address=store)


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# ---- prefill -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Out:
    """A room on the prefill side."""

    room: int
    rid: str
    peer: bytes | None = None  # the claiming decode server's socket identity
    claim: m.Claim | None = None
    queue: list[tuple[int, list[int]]] = field(default_factory=list)  # (first page, pages)
    done: m.Done | None = None
    done_sent: bool = False
    pump: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None


class PrefillAgent(TransferAgent):
    """The prefill side: binds the bootstrap port; sends each room's pages to its claimer."""

    side = "prefill"

    def __init__(self, pool: KVPool, backend: str, host: str, port: int, **timeouts: float):
        super().__init__(pool, backend, **timeouts)
        self.host, self.port = host, port
        self.rooms: dict[int, _Out] = {}
        # Claims whose request has not reached this server yet: room -> (peer, claim, timer).
        self.unmatched: dict[int, tuple[bytes, m.Claim, asyncio.TimerHandle]] = {}
        self._relay_peer: bytes | None = None  # torch: the one decode server paired with us

    def num_rooms(self) -> int:
        return len(self.rooms)

    # -- the scheduler's calls -----------------------------------------------------------

    def expect(self, room: int, rid: str) -> None:
        """A request with this room is here: its claim may come (or has come)."""
        self._call(self._expect, room, rid)

    def send(self, room: int, first_page: int, pages: list[int]) -> None:
        """The request's pages [first_page, first_page + len(pages)) are computed."""
        self._call(self._send, room, first_page, list(pages))

    def finish(self, room: int, done: m.Done) -> None:
        """Every page is computed and queued; `done` follows them."""
        self._call(self._finish, room, done)

    def drop(self, room: int, message: str) -> None:
        """The request ended here (aborted, failed): its decode side is told why."""
        self._call(self._drop, room, message)

    # -- inside the loop -----------------------------------------------------------------

    async def _setup(self) -> None:
        self.sock = self.zmq.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(endpoint(self.host, self.port))
        except zmq.ZMQError as e:
            raise RuntimeError(
                f"disaggregation bootstrap port {self.port} on {self.host}: {e}; give a free "
                "--disaggregation-bootstrap-port"
            ) from None
        if self.backend == "shm":
            self.relay = create_relay(self._relay_context(0, f"pd{self.port}", None))
        self._spawn(self._read())
        self._spawn(self._ping())

    def _expect(self, room: int, rid: str) -> None:
        out = self.rooms[room] = _Out(room, rid)
        waiting = self.unmatched.pop(room, None)
        if waiting is not None:
            peer, claim, timer = waiting
            timer.cancel()
            self._spawn(self._match(out, peer, claim))
        else:
            why = (
                f"no decode server claimed bootstrap_room {room} within "
                f"{self.bootstrap_timeout:g} s (the request must reach a decode server too, "
                "with the same bootstrap fields)"
            )
            out.timer = self.loop.call_later(self.bootstrap_timeout, self._expire, room, why)

    def _send(self, room: int, first_page: int, pages: list[int]) -> None:
        out = self.rooms.get(room)
        if out is not None and pages:
            out.queue.append((first_page, pages))
            self._kick(out)

    def _finish(self, room: int, done: m.Done) -> None:
        out = self.rooms.get(room)
        if out is not None:
            out.done = done
            self._kick(out)

    def _drop(self, room: int, message: str) -> None:
        out = self.rooms.pop(room, None)
        if out is not None:
            self._end(out)
            if out.peer is not None:
                self._spawn(self._tell(out.peer, m.Failed(room=room, message=message)))

    def _expire(self, room: int, message: str) -> None:
        out = self.rooms.pop(room, None)
        if out is not None:
            self._end(out)
            if out.peer is not None:
                self._spawn(self._tell(out.peer, m.Failed(room=room, message=message)))
            self._emit(Lost(room, message))

    def _lose(self, out: _Out, message: str) -> None:
        if self.rooms.get(out.room) is out:
            del self.rooms[out.room]
            self._end(out)
            self._emit(Lost(out.room, message))

    def _end(self, out: _Out) -> None:
        if out.timer is not None:
            out.timer.cancel()
        if out.pump is not None and out.pump is not asyncio.current_task():
            out.pump.cancel()
        if self.relay is not None:
            self.relay.cleanup(self._relay_rid(out))

    @staticmethod
    def _relay_rid(out: _Out) -> str:
        return f"room-{out.room}"

    async def _read(self) -> None:
        while True:
            peer, data = await self.sock.recv_multipart()
            try:
                msg = m.decode(data)
            except Exception:
                logger.warning("dropped a bootstrap message this server cannot decode")
                continue
            self._on_message(peer, msg)

    def _on_message(self, peer: bytes, msg: m.Message) -> None:
        if isinstance(msg, m.ChunkAck):
            if self.relay is not None:
                self.relay.acknowledge(msg.relay)
        elif isinstance(msg, m.Claim):
            self._on_claim(peer, msg)
        elif isinstance(msg, m.DoneAck):
            out = self.rooms.pop(msg.room, None)
            if out is not None:
                self._end(out)
                self._emit(Sent(msg.room))
        elif isinstance(msg, m.Cancel):
            waiting = self.unmatched.pop(msg.room, None)
            if waiting is not None:
                waiting[2].cancel()
            out = self.rooms.get(msg.room)
            if out is not None:
                self._lose(out, f"the decode server ended the request: {msg.message}")

    def _on_claim(self, peer: bytes, claim: m.Claim) -> None:
        out = self.rooms.get(claim.room)
        if out is None:
            if claim.room in self.unmatched:
                why = f"bootstrap_room {claim.room} is claimed already"
                self._spawn(self._tell(peer, m.Failed(room=claim.room, message=why)))
                return
            why = (
                f"no request with bootstrap_room {claim.room} reached the prefill server within "
                f"{self.bootstrap_timeout:g} s"
            )
            timer = self.loop.call_later(self.bootstrap_timeout, self._unclaimed, claim.room, why)
            self.unmatched[claim.room] = (peer, claim, timer)
        elif out.claim is not None:
            why = f"bootstrap_room {claim.room} is claimed already"
            self._spawn(self._tell(peer, m.Failed(room=claim.room, message=why)))
        else:
            self._spawn(self._match(out, peer, claim))

    def _unclaimed(self, room: int, message: str) -> None:
        waiting = self.unmatched.pop(room, None)
        if waiting is not None:
            self._spawn(self._tell(waiting[0], m.Failed(room=room, message=message)))

    async def _match(self, out: _Out, peer: bytes, claim: m.Claim) -> None:
        out.peer, out.claim = peer, claim
        if out.timer is not None:
            out.timer.cancel()
        why = None
        if claim.layout != self.pool.layout:
            why = (
                f"the two servers' KV pages differ (prefill {self.pool.layout}, decode "
                f"{claim.layout}): serve the same model with the same --kv-cache-dtype and "
                "--page-size on both"
            )
        elif claim.backend != self.backend:
            why = (
                f"--disaggregation-transfer-backend differs (prefill {self.backend}, decode "
                f"{claim.backend})"
            )
        else:
            why = await self._pair_relay(peer)
        if why is not None:
            await self._tell(peer, m.Failed(room=out.room, message=why))
            return self._lose(out, why)
        out.timer = self.loop.call_later(
            self.waiting_timeout,
            self._expire,
            out.room,
            f"the KV transfer of bootstrap_room {out.room} did not finish within "
            f"{self.waiting_timeout:g} s",
        )
        if await self._tell(peer, m.Accepted(room=out.room)):
            self._kick(out)
        else:
            self._lose(out, "the decode server that claimed the request went away")

    async def _pair_relay(self, peer: bytes) -> str | None:
        """torch: the process group with the (one) decode server, made on its first claim."""
        if self.backend != "torch":
            return None
        if self._relay_peer is None:
            self._relay_peer = peer
            store = f"{self.host}:{self.port + 1}"
            ctx = self._relay_context(0, f"pd{self.port}", store)
            try:
                self.relay = await self.loop.run_in_executor(None, create_relay, ctx)
            except Exception as e:
                self._relay_peer = None
                return f"the torch transfer group could not form: {e}"
        if peer != self._relay_peer:
            return (
                "the torch transfer backend pairs one prefill server with one decode server; "
                "use shm on one host, or one decode server per prefill server"
            )
        while self.relay is None:  # the group is forming for an earlier claim
            await asyncio.sleep(0.01)
        return None

    def _kick(self, out: _Out) -> None:
        if out.claim is not None and (out.pump is None or out.pump.done()):
            out.pump = self._spawn(self._pump(out))

    async def _pump(self, out: _Out) -> None:
        """Sends the room's queued pages, chunk by chunk, then its Done."""
        assert out.claim is not None and out.peer is not None
        skip = out.claim.skip_pages
        try:
            while out.queue:
                first, pages = out.queue.pop(0)
                if first < skip:
                    pages, first = pages[skip - first :], max(first, skip)
                for i in range(0, len(pages), self.pages_per_chunk):
                    part = pages[i : i + self.pages_per_chunk]
                    op = await self.relay.put_payload_async(
                        PagePayload(self.pool, part), self._relay_rid(out), 1
                    )
                    chunk = m.Chunk(
                        room=out.room, first_page=first + i, num_pages=len(part), relay=op.metadata
                    )
                    if not await self._tell(out.peer, chunk):
                        return self._lose(out, "the decode server went away during the transfer")
            if out.done is not None and not out.done_sent:
                out.done_sent = True
                if not await self._tell(out.peer, out.done):
                    self._lose(out, "the decode server went away during the transfer")
        except RelayError as e:
            why = f"the KV transfer of bootstrap_room {out.room} failed: {e}"
            await self._tell(out.peer, m.Failed(room=out.room, message=why))
            self._lose(out, why)

    async def _tell(self, peer: bytes, msg: m.Message) -> bool:
        """Sends `msg` to `peer`; False when the peer is gone."""
        try:
            await self.sock.send_multipart([peer, m.encode(msg)])
            return True
        except zmq.ZMQError:
            return False

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(PING_S)
            for out in [o for o in self.rooms.values() if o.peer is not None]:
                assert out.peer is not None
                if not await self._tell(out.peer, m.Ping(room=out.room)):
                    self._lose(out, "the decode server that claimed the request went away")


# ---- decode --------------------------------------------------------------------------------


@dataclass(eq=False)
class _In:
    """A room on the decode side."""

    room: int
    rid: str
    where: str  # the prefill server's bootstrap endpoint
    receiving: int = 0  # chunks being read from the relay
    done: m.Done | None = None
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Peer:
    sock: Any
    rooms: set[int] = field(default_factory=set)


class DecodeAgent(TransferAgent):
    """The decode side: claims rooms at prefill servers and receives their pages."""

    side = "decode"

    def __init__(self, pool: KVPool, backend: str, **timeouts: float):
        super().__init__(pool, backend, **timeouts)
        self.rooms: dict[int, _In] = {}
        self.peers: dict[str, _Peer] = {}

    def num_rooms(self) -> int:
        return len(self.rooms)

    # -- the scheduler's calls -----------------------------------------------------------

    def claim(self, room: int, rid: str, host: str, port: int, skip_pages: int) -> None:
        """Asks the prefill server at host:port for the room's pages from `skip_pages` on."""
        self._call(self._claim, room, rid, endpoint(host, port), skip_pages)

    def drop(self, room: int, message: str) -> None:
        """The request ended here: the prefill server stops its side."""
        self._call(self._drop, room, message)

    def store(self, pages: list[int], data: torch.Tensor) -> None:
        """Writes an Arrived chunk into these pages (scheduler thread)."""
        self.pool.scatter_pages(pages, data)

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
            data = await peer.sock.recv()
            try:
                msg = m.decode(data)
            except Exception:
                logger.warning("dropped a bootstrap message this server cannot decode")
                continue
            into = self.rooms.get(msg.room)
            if isinstance(msg, m.Chunk):
                if into is not None:
                    into.receiving += 1  # now: the Done behind it must wait for it
                self._spawn(self._receive(peer, into, msg))
            elif into is None:
                continue  # a room this side dropped: Ping, Done, Failed go nowhere
            elif isinstance(msg, m.Accepted):
                self._rearm(into)
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

    async def _receive(self, peer: _Peer, into: _In | None, chunk: m.Chunk) -> None:
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
            self._emit(Arrived(chunk.room, chunk.first_page, chunk.num_pages, data, release))
        except RelayError as e:
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

    async def _pair_relay(self, into: _In | None) -> Any:
        """torch: the process group with the prefill server, made on its first chunk."""
        raise RelayError("the torch transfer backend is not paired")

    def _maybe_ready(self, peer: _Peer, into: _In) -> None:
        if into.done is None or into.receiving or self.rooms.get(into.room) is not into:
            return
        self._forget(into.room)
        self._emit(Ready(into.room, into.done))
        self._spawn(self._send(peer, m.DoneAck(room=into.room)))
