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
from dataclasses import dataclass
from typing import Any

import torch
import zmq
import zmq.asyncio

from cadence.disaggregation import messages as m
from cadence.mem_cache.kv_pool import KVPool
from cadence.pipeline.config import RelayConfig
from cadence.pipeline.payload import copy_bytes
from cadence.pipeline.relay import RelayContext

logger = logging.getLogger("cadence.disaggregation")

CHUNK_BYTES = 16 << 20  # at most this much per chunk: fewer round trips, each worth its cost
PING_S = 1.0  # how often a prefill server checks that its claimed rooms' decode servers live
ANSWER_MARGIN_S = 1.0  # a decode side's own deadline runs past the prefill side's by this
CREDITS = 8  # relay slots in flight per prefill server
SLOT_MB = 16.0


# ---- what the scheduler learns -------------------------------------------------------------


@dataclass
class Arrived:
    """Pages [first_page, first_page + num_pages) of a room: as bytes (`data`, from a relay),
    or where they lie in the prefill server's shared pool (`source`: its layers and page
    ids). The scheduler writes them into the request's pages (`DecodeAgent.store`), then
    calls `release`."""

    room: int
    first_page: int
    num_pages: int
    data: torch.Tensor | None
    _release: Callable[[], None] | None = None
    source: tuple[list[torch.Tensor], list[int]] | None = None

    def release(self) -> None:
        self.data = None  # a lent view: dropping it hands the sender's memory back
        release, self._release = self._release, None
        if release is not None:
            release()


@dataclass
class Ready:
    """Every page of the room has arrived (once the Arrived before it are stored): the
    scheduler stores them, then `commit`s; `Committed` follows, or `Lost`."""

    room: int
    done: m.Done


@dataclass
class Committed:
    """The prefill server confirmed the room's pages were its own while they were copied:
    the request goes on with `done.token`."""

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


Event = Arrived | Ready | Committed | Sent | Lost


class PagePayload:
    """Pages of a pool as a relay payload (`Relay.put_payload_async`): gathered straight into
    the relay's memory, layer by layer (`KVPool.gather_pages`)."""

    def __init__(self, pool: KVPool, pages: list[int]):
        self.pool, self.pages = pool, pages
        self.nbytes = len(pages) * pool.page_nbytes

    def pack_into(self, dst: torch.Tensor, start: int = 0, end: int | None = None) -> None:
        """Bytes [start, end) of the packed pages into dst[start:end]: the layers wholly
        inside gathered in place, a layer cut by the range through a scratch buffer (a relay
        splits a large put in parts, packed by several threads at once)."""
        end = self.nbytes if end is None else end
        per_layer = self.nbytes // len(self.pool.kv_buffer)
        first, last = -(-start // per_layer), end // per_layer  # whole layers [first, last)
        if first < last:
            self.pool.gather_pages(
                self.pages, dst[first * per_layer : last * per_layer], slice(first, last)
            )
        for layer in {start // per_layer, (end - 1) // per_layer}:
            lo, hi = max(start, layer * per_layer), min(end, (layer + 1) * per_layer)
            if lo < hi and not first <= layer < last:
                scratch = torch.empty(per_layer, dtype=torch.uint8)
                self.pool.gather_pages(self.pages, scratch, slice(layer, layer + 1))
                base = layer * per_layer
                copy_bytes(dst[lo:hi], scratch[lo - base : hi - base])

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

    def _dispatch(self, peer: Any, data: bytes) -> None:
        """One bootstrap message to `_on_message`; a message that cannot be decoded or
        handled is logged (and its room ends, `_message_failed`), never the channel's end."""
        try:
            msg = m.decode(data)
        except Exception:
            logger.warning("dropped a bootstrap message this server cannot decode")
            return
        try:
            self._on_message(peer, msg)
        except Exception:
            logger.exception("handling a bootstrap message failed")
            self._message_failed(msg)

    def _on_message(self, peer: Any, msg: m.Message) -> None:
        raise NotImplementedError

    def _message_failed(self, msg: m.Message) -> None:
        """`msg` could not be handled: what its room becomes (nothing by default)."""

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
