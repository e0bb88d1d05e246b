"""Prefill/decode disaggregation in the scheduler: the two halves of a request with a room.

A PD router sends the same request to a prefill server and a decode server, with the same
`bootstrap_room`. On the prefill server (`PrefillHandoff`) the request runs its prompt as any
other (chunked prefill, the prefix cache) and samples its first token; each chunk's whole
pages go to the decode server as soon as they are computed, the last (partial) page and the
first token when the prompt is done. It then waits, holding its pages, until the decode
server has everything (`Sent`), and answers its client with that one token (SGLang's prefill
forces max_new_tokens to 1). On the decode server (`DecodeIntake`) the request is admitted
for pages first (its cached prefix is matched: those pages are not sent), claims the room,
takes the pages as they arrive, and joins the running batch with the first token once the
prefill server confirms the pages were still the room's while they were copied.

The transfer itself is the agent's (`cadence.disaggregation.agent`), on its own thread; this
module runs on the scheduler's thread only, so the scheduler's invariants hold: every page
is the KV manager's, and a request that ends for any reason (an abort, a failure on the
other side, a timeout) releases its pages once, here.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from cadence.disaggregation import messages
from cadence.disaggregation.agent import Arrived, Committed, Lost, Ready, Sent
from cadence.disaggregation.decode_agent import DecodeAgent
from cadence.disaggregation.prefill_agent import PrefillAgent
from cadence.mem_cache.kv_manager import KVManager
from cadence.scheduler.req import Req


def transfer_failed(message: str) -> dict[str, Any]:
    """How a request ends when its other half or its transfer failed (SGLang: a 500)."""
    return {"type": "abort", "status_code": 500, "message": message}


class PrefillHandoff:
    """The prefill server's side: see the module docstring."""

    mode = "prefill"

    def __init__(self, agent: PrefillAgent, kv: KVManager):
        self.agent = agent
        self.kv = kv
        self.live: dict[int, Req] = {}  # room -> its request, from arrival to Sent
        self.queued_pages: dict[int, int] = {}  # room -> pages handed to the agent so far
        self.handing: dict[int, Req] = {}  # first token out, waiting for the decode side

    @property
    def waiting(self) -> list[Req]:
        """Requests that wait here, outside the scheduler's queues."""
        return list(self.handing.values())

    has_work = False  # what it waits for comes as the agent's events

    def add(self, req: Req) -> str | None:
        """A request with a room arrived; why it is refused, or None."""
        assert req.bootstrap is not None
        room = req.bootstrap[2]
        if room in self.live:
            return f"bootstrap_room {room} is in use by another request on this prefill server"
        if req.params.max_new_tokens > 1:  # SGLang's prefill: the decode side samples the rest
            req.params = _with_max_new_tokens(req.params, 1)
        self.live[room] = req
        self.queued_pages[room] = 0
        self.agent.expect(room, req.rid)
        return None

    def progress(self, req: Req) -> None:
        """After a prefill chunk: its whole pages go out now."""
        self._queue(req, req.num_computed // self.kv.page_size)

    def hand_over(self, req: Req, done: messages.Done) -> None:
        """The prompt is done and `done` holds its first token: the rest goes out."""
        room = self.room_of(req)
        self._queue(req, self.kv.pages_for(req.num_computed))
        self.handing[room] = req
        self.agent.finish(room, done)

    def _queue(self, req: Req, num_pages: int) -> None:
        room = self.room_of(req)
        sent = self.queued_pages.get(room)
        if sent is not None and num_pages > sent:
            self.agent.send(room, sent, req.pages[sent:num_pages])
            self.queued_pages[room] = num_pages

    def ended(self, req: Req, reason: dict[str, Any]) -> None:
        """`req` ends here: a room still open is closed, its decode side told why."""
        if req.bootstrap is None or self.live.get(req.bootstrap[2]) is not req:
            return
        room = req.bootstrap[2]
        self._forget(room)
        self.agent.drop(room, reason.get("message") or "the prefill server ended the request")

    def _forget(self, room: int) -> Req | None:
        self.queued_pages.pop(room, None)
        self.handing.pop(room, None)
        return self.live.pop(room, None)

    def take_endings(self) -> list[tuple[Req, dict[str, Any]]]:
        """Requests the agent's news ends: sent (answered with their one token) or lost."""
        endings = []
        for event in self.agent.take_events():
            if isinstance(event, Sent):
                req = self._forget(event.room)
                if req is not None:
                    endings.append((req, {"type": "length", "length": 1}))
            elif isinstance(event, Lost):
                req = self._forget(event.room)
                if req is not None:
                    endings.append((req, transfer_failed(event.message)))
        return endings

    def stats(self) -> dict[str, Any]:
        return {"mode": self.mode, "rooms": len(self.live), **self.agent.stats()}

    @staticmethod
    def room_of(req: Req) -> int:
        assert req.bootstrap is not None
        return req.bootstrap[2]


class DecodeIntake:
    """The decode server's side: see the module docstring."""

    mode = "decode"

    def __init__(self, agent: DecodeAgent, kv: KVManager, context_len: int):
        self.agent = agent
        self.kv = kv
        self.context_len = context_len
        self.queue: deque[Req] = deque()  # waiting for pages
        self.claimed: dict[int, Req] = {}  # room -> request whose pages are coming

    @property
    def waiting(self) -> list[Req]:
        return [*self.queue, *self.claimed.values()]

    def add(self, req: Req) -> str | None:
        assert req.bootstrap is not None
        room = req.bootstrap[2]
        if room in self.claimed or any(r.bootstrap == req.bootstrap for r in self.queue):
            return f"bootstrap_room {room} is in use by another request on this decode server"
        self.queue.append(req)
        return None

    def admit(self) -> None:
        """Requests that get their pages claim their rooms, in arrival order."""
        page = self.kv.page_size
        while self.queue:
            req = self.queue[0]
            handle = self.kv.admit(
                req.input_ids, req.total_tokens_needed(self.context_len), req.lora_uid
            )
            if handle is None:
                return  # memory frees as running requests end
            self.queue.popleft()
            req.kv = handle
            req.was_admitted = True
            self.kv.grow(handle, len(req.input_ids))
            assert req.bootstrap is not None
            host, port, room = req.bootstrap
            assert host is not None and port is not None
            self.claimed[room] = req
            self.agent.claim(room, req.rid, host, port, handle.num_cached_tokens // page)

    @property
    def has_work(self) -> bool:
        """Whether the next step would claim a room: the first waiting request fits now."""
        if not self.queue:
            return False
        usage = self.kv.usage()
        need = self.kv.pages_for(self.queue[0].total_tokens_needed(self.context_len))
        return need <= usage.num_free - usage.num_promised + usage.num_evictable

    def ended(self, req: Req, reason: dict[str, Any]) -> None:
        if req.bootstrap is None:
            return
        if req in self.queue:
            self.queue.remove(req)
        room = req.bootstrap[2]
        if self.claimed.get(room) is req:
            del self.claimed[room]
            self.agent.drop(room, reason.get("message") or "the decode server ended the request")

    def take_news(self) -> tuple[list[tuple[Req, messages.Done]], list[tuple[Req, str]]]:
        """Stores what arrived; returns the requests ready to join the batch (with their
        first token) and those whose transfer failed (with why)."""
        ready, lost = [], []
        for event in self.agent.take_events():
            if isinstance(event, Arrived):
                req = self.claimed.get(event.room)
                if req is not None:
                    first = event.first_page
                    self.agent.store(req.pages[first : first + event.num_pages], event)
                event.release()
            elif isinstance(event, Ready):  # all stored (the Arrived before it): confirm
                if event.room in self.claimed:
                    self.agent.commit(event.room)
            elif isinstance(event, Committed):
                req = self.claimed.pop(event.room, None)
                if req is not None:
                    ready.append((req, event.done))
            elif isinstance(event, Lost):
                req = self.claimed.pop(event.room, None)
                if req is not None:
                    lost.append((req, event.message))
        return ready, lost

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "waiting_for_pages": len(self.queue),
            "claimed": len(self.claimed),
            **self.agent.stats(),
        }


def _with_max_new_tokens(params, n: int):
    import msgspec

    return msgspec.structs.replace(params, max_new_tokens=n)


def build_disaggregation(args, kv: KVManager, pool, context_len: int):
    """The scheduler's PD side for --disaggregation-mode (None for null), its agent started."""
    mode = args.disaggregation_mode
    if mode == "null":
        return None
    timeouts = {
        "bootstrap_timeout": args.effective_bootstrap_timeout,
        "waiting_timeout": args.effective_waiting_timeout,
    }
    backend = args.disaggregation_transfer_backend
    if mode == "prefill":
        agent: Any = PrefillAgent(
            pool, backend, args.host, args.disaggregation_bootstrap_port, **timeouts
        )
        agent.start()
        return PrefillHandoff(agent, kv)
    agent = DecodeAgent(pool, backend, **timeouts)
    agent.start()
    return DecodeIntake(agent, kv, context_len)
