"""The prefill server's transfer agent: binds the bootstrap port, matches each claim with its
request's room, and sends the room's pages to the claimer chunk by chunk, then its Done
(the protocol: `messages.py`; threads and ownership: `agent.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from cadence.disaggregation import messages as m
from cadence.disaggregation.agent import (
    PING_S,
    Lost,
    PagePayload,
    Sent,
    TransferAgent,
    endpoint,
    logger,
)
from cadence.mem_cache.kv_pool import KVPool
from cadence.pipeline.relay import RelayError, create_relay


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
    accepted: bool = False  # matched, checked, and the relay is ready: pages may go
    num_sent: int = 0  # pages sent so far
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
        self.shared: Any = None  # shm: the pool's shared-memory segment, once it is there

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
            self._share_pool()
        self._spawn(self._read())
        self._spawn(self._ping())

    def _share_pool(self) -> None:
        """Moves the KV pool into shared memory (the scheduler waits in `start`: no forward
        runs), so that decode servers copy pages from where they lie. Where /dev/shm has no
        room for it, pages go through the relay's slots instead."""
        from cadence.pipeline.relay.shm import Segment, segment_name

        if str(self.pool.device) != "cpu":
            return
        name = segment_name(os.getpid(), f"pdkv{self.port}", "pool")
        segment = None
        try:
            segment = Segment(name, self.pool.num_bytes, create=True)
            assert segment.tensor is not None  # the pool is never empty
            self.pool.move_into(segment.tensor)
        except (OSError, ValueError, RuntimeError) as e:
            logger.warning(
                "the KV pool stays private, pages go through the relay's slots (one copy more); "
                "give /dev/shm room for %d MB to share it: %s",
                self.pool.num_bytes >> 20,
                e,
            )
            if segment is not None:
                with contextlib.suppress(OSError):
                    segment.unlink()
            return
        self.shared = segment

    def _pool_info(self) -> dict[str, Any] | None:
        if self.shared is None:
            return None
        return {"segment": self.shared.name, "num_pages": self.pool.kv_buffer[0].shape[2]}

    def _teardown(self) -> None:
        if self.shared is not None:  # the mapping stays: the pool lives on in it
            with contextlib.suppress(OSError):
                self.shared.unlink()
        super()._teardown()

    def _expect(self, room: int, rid: str) -> None:
        out = self.rooms[room] = _Out(room, rid)
        waiting = self.unmatched.pop(room, None)
        if waiting is not None:
            peer, claim, timer = waiting
            timer.cancel()
            self._spawn(self._match(out, peer, claim))
        else:
            why = (
                f"no decode server claimed bootstrap_room {room} at bootstrap port "
                f"{self.port} within {self.bootstrap_timeout:g} s (the request must reach a "
                f"decode server too, with bootstrap_port {self.port} and this server's host)"
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
            self._dispatch(peer, data)

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
                self._spawn(self._tell(peer, m.Confirmed(room=msg.room)))
            else:  # its pages went to others meanwhile: what was copied may not be its
                why = (
                    f"the prefill server ended bootstrap_room {msg.room} before the decode "
                    "server had its pages (aborted or timed out there)"
                )
                self._spawn(self._tell(peer, m.Failed(room=msg.room, message=why)))
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
        out.peer, out.claim = peer, claim  # claimed: no other claim takes it
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
        if self.rooms.get(out.room) is not out:
            return  # dropped while the relay formed
        if await self._tell(peer, m.Accepted(room=out.room, pool=self._pool_info())):
            out.accepted = True
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
        if out.accepted and (out.pump is None or out.pump.done()):
            out.pump = self._spawn(self._pump(out))

    async def _pump(self, out: _Out) -> None:
        """Sends the room's queued pages, chunk by chunk, then its Done. A chunk leaves the
        queue only once it is on its way: a pump that fails ends the room, never a room
        that looks complete without its pages."""
        assert out.claim is not None and out.peer is not None
        skip = out.claim.skip_pages
        try:
            while out.queue:
                first, pages = out.queue[0]
                if first < skip:
                    pages, first = pages[skip - first :], max(first, skip)
                part = pages[: self.pages_per_chunk]
                if part:
                    chunk = m.Chunk(room=out.room, first_page=first, num_pages=len(part), relay={})
                    if self.shared is not None:
                        chunk.pages = part  # read where they lie
                    else:
                        op = await self.relay.put_payload_async(
                            PagePayload(self.pool, part), self._relay_rid(out), 1
                        )
                        chunk.relay = op.metadata
                    if not await self._tell(out.peer, chunk):
                        return self._lose(out, "the decode server went away during the transfer")
                    out.num_sent += len(part)
                rest = pages[len(part) :]
                if rest:
                    out.queue[0] = (first + len(part), rest)
                else:
                    out.queue.pop(0)
            if out.done is not None and not out.done_sent:
                out.done_sent = True
                done = msgspec.structs.replace(out.done, num_pages=out.num_sent)
                if not await self._tell(out.peer, done):
                    self._lose(out, "the decode server went away during the transfer")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            why = f"the KV transfer of bootstrap_room {out.room} failed: {e}"
            if not isinstance(e, RelayError):
                logger.exception("sending bootstrap_room %d failed", out.room)
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
