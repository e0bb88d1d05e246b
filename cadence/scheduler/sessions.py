"""Sessions (SGLang's): requests that continue each other, their KV pinned in the prefix cache.

A session is opened by the front (`OpenSessionReqInput`) and lives in the scheduler. A
generate request with `session_params` names the session and, usually, the earlier request
(`rid`) it continues: its prompt becomes that request's prompt and output (cut at `offset`
when given, without the output with `drop_previous_output`) followed by the new input. Each
turn is remembered by rid, so a client may branch: continuing an earlier rid again keeps
both branches; `replace` drops what followed it (aborting it if it still runs), and
`replace` without a rid starts the session over. A streaming session (`streaming=True`)
keeps one line of history: every request appends to the latest finished one.

While the session is open the KV of each remembered turn stays pinned (through the KV
manager, which keeps it locked in the prefix cache), so the next turn prefills only its new
tokens. Closing the session, a timeout, or
a replace unpins those pages: they become ordinary, evictable cache. Under memory pressure
(a request that cannot be admitted while nothing runs) the scheduler unpins the least
recently used sessions first; they stay open and simply recompute what was evicted.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cadence.io_struct import (
    OpenSessionReqInput,
    OpenSessionReqOutput,
    SessionParams,
)
from cadence.mem_cache.kv_manager import CacheNode, KVManager
from cadence.scheduler.req import Req

logger = logging.getLogger(__name__)

MAX_SESSIONS = 4096  # open at once; a client that never closes its sessions cannot grow us


def auto_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before every text it encodes, if it does (a session's
    appended turn drops it); None when it adds none."""
    try:
        ids = tokenizer.encode("a")
        bos = tokenizer.bos_token_id
    except Exception:  # no tokenizer, or one without these: nothing to drop
        return None
    return bos if bos is not None and ids and ids[0] == bos else None


@dataclass(eq=False)
class Turn:
    """One request of a session."""

    rid: str
    parent: Turn | None
    req: Req
    children: list[Turn] = field(default_factory=list)
    node: CacheNode | None = None  # its KV pinned in the prefix cache once it ended

    @property
    def is_finished(self) -> bool:
        return self.req.is_finished

    def history(self) -> list[int]:
        """The tokens a continuation starts from: this turn's prompt and what it generated."""
        req = self.req
        return req.input_ids + req.output_ids[: req.params.max_new_tokens]


@dataclass(eq=False)
class Session:
    session_id: str
    streaming: bool
    timeout: float | None  # idle seconds before it closes itself; None: never
    turns: dict[str, Turn] = field(default_factory=dict)
    latest: Turn | None = None  # streaming: the turn the next request appends to
    last_active: float = field(default_factory=time.monotonic)

    def is_timed_out(self, now: float) -> bool:
        return self.timeout is not None and now - self.last_active > self.timeout


class SessionError(Exception):
    """A request's session_params cannot be honoured (the request ends with a 400)."""


class SessionController:
    """Every open session of one scheduler; only the scheduler's thread calls it."""

    def __init__(
        self,
        kv: KVManager,
        abort: Callable[[Req, str], None],
        bos_token_id: int | None = None,
        default_timeout: float | None = None,
    ):
        self.kv = kv
        self.abort = abort  # ends a live request of a session (replace)
        self.bos_token_id = bos_token_id
        self.default_timeout = default_timeout
        self.sessions: dict[str, Session] = {}
        self._last_reap = 0.0

    # ---- open / close ------------------------------------------------------------------

    def open(self, msg: OpenSessionReqInput) -> OpenSessionReqOutput:
        session_id = msg.session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            return OpenSessionReqOutput(
                session_id=session_id,
                success=False,
                message=f"session {session_id!r} is already open",
            )
        if len(self.sessions) >= MAX_SESSIONS:
            return OpenSessionReqOutput(
                session_id=None,
                success=False,
                message=f"{MAX_SESSIONS} sessions are open; close one first",
            )
        timeout = msg.timeout if msg.timeout is not None else self.default_timeout
        self.sessions[session_id] = Session(session_id, bool(msg.streaming), timeout)
        return OpenSessionReqOutput(session_id=session_id, success=True)

    def close(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        for turn in session.turns.values():
            self._unpin(turn)
            turn.req.session_turn = None
        return True

    def reap(self, now: float) -> None:
        """Closes sessions idle past their timeout (checked at most once a second)."""
        if now - self._last_reap < 1.0:
            return
        self._last_reap = now
        for sid in [sid for sid, s in self.sessions.items() if s.is_timed_out(now)]:
            logger.info("session %s timed out; closing it", sid)
            self.close(sid)

    # ---- requests ----------------------------------------------------------------------

    def attach(self, req: Req, params: SessionParams) -> None:
        """Makes `req` a turn of its session: its prompt becomes the continued history plus
        its own input. Raises SessionError (nothing changed) when that cannot be done."""
        session = self.sessions.get(params.id)
        if session is None:
            raise SessionError(
                f"session_params.id (gRPC session_id): session {params.id!r} is not open; "
                "open it with /open_session first"
            )
        session.last_active = time.monotonic()
        if req.rid in session.turns:
            raise SessionError(f"rid {req.rid!r} is already a request of this session")
        parent = self._parent(session, params)
        if parent is not None:
            history = parent.req.input_ids if params.drop_previous_output else parent.history()
            if params.offset:
                history = history[: params.offset]
            new = req.input_ids
            if new and self.bos_token_id is not None and new[0] == self.bos_token_id:
                new = new[1:]  # an appended turn does not start the sequence again
            req.input_ids = history + new
        if session.streaming:
            parent = None  # one line of history: nothing to branch from later
        turn = Turn(req.rid, parent, req)
        if parent is not None:
            parent.children.append(turn)
        session.turns[req.rid] = turn
        req.session_turn = turn
        req.session_id = session.session_id

    def _parent(self, session: Session, params: SessionParams) -> Turn | None:
        if session.streaming:
            if params.replace or params.drop_previous_output or params.offset:
                raise SessionError(
                    "session_params: a streaming session only appends "
                    "(no replace, offset or drop_previous_output)"
                )
            return session.latest
        if params.replace and params.rid is None:
            for turn in list(session.turns.values()):
                self._drop(session, turn)
            return None
        if params.rid is None:
            return None
        parent = session.turns.get(params.rid)
        if parent is None:
            raise SessionError(
                f"session_params.rid: {params.rid!r} is not a request of this session"
            )
        if params.replace:
            if not parent.is_finished:
                self.abort(parent.req, "replaced in its session")
            for child in list(parent.children):
                self._drop_subtree(session, child)
            parent.children = []
        elif not parent.is_finished:
            raise SessionError(
                f"session_params.rid: request {params.rid!r} has not finished; "
                "a session continues finished requests"
            )
        return parent

    def fit_prompt(self, req: Req, context_len: int) -> dict[str, Any] | None:
        """A session's history plus the new input must leave room for one token; generation
        is cut at the context length (SGLang's rule). The abort reason when it cannot."""
        num = len(req.input_ids)
        if num >= context_len:
            return {
                "type": "abort",
                "status_code": 400,
                "param": "session_params",
                "message": f"the session's history plus this input is {num} tokens, at "
                f"least the context length ({context_len}); start a new session",
            }
        if num + req.params.max_new_tokens > context_len:
            req.params.max_new_tokens = context_len - num
        return None

    def on_end(self, req: Req, ok: bool) -> None:
        """A turn ended, before it releases its KV: pin what it leaves in the prefix cache
        while the session stays open. `ok` is False for a failed request (nothing pinned)."""
        turn: Turn | None = getattr(req, "session_turn", None)
        if turn is None or req.session_id is None:
            return
        session = self.sessions.get(req.session_id)
        if session is None or session.turns.get(turn.rid) is not turn:
            return  # closed or replaced meanwhile
        session.last_active = time.monotonic()
        if ok and req.kv is not None:
            turn.node = self.kv.pin(req.kv)
        if session.streaming:
            aborted = (req.finished_reason or {}).get("type") == "abort"
            if ok and not aborted:
                if session.latest is not None:
                    self._drop(session, session.latest)
                session.latest = turn
            else:
                self._drop(session, turn)

    # ---- memory pressure ---------------------------------------------------------------

    def unpin_lru(self) -> bool:
        """Unpins every turn of the least recently active session that pins anything; True
        when something was unpinned. The session stays open."""
        pinned = [s for s in self.sessions.values() if any(t.node for t in s.turns.values())]
        if not pinned:
            return False
        session = min(pinned, key=lambda s: s.last_active)
        logger.info("unpinning session %s's KV to make room", session.session_id)
        for turn in session.turns.values():
            self._unpin(turn)
        return True

    def unpin_all(self) -> None:
        """Drops every pin (new weights: the pinned KV is stale)."""
        for session in self.sessions.values():
            for turn in session.turns.values():
                self._unpin(turn)

    # ---- internals ---------------------------------------------------------------------

    def _unpin(self, turn: Turn) -> None:
        if turn.node is not None:
            self.kv.unpin(turn.node)
            turn.node = None

    def _drop(self, session: Session, turn: Turn) -> None:
        self._drop_subtree(session, turn)
        if turn.parent is not None and turn in turn.parent.children:
            turn.parent.children.remove(turn)
        if session.latest is turn:
            session.latest = None

    def _drop_subtree(self, session: Session, turn: Turn) -> None:
        for child in turn.children:
            self._drop_subtree(session, child)
        turn.children = []
        if not turn.is_finished:
            self.abort(turn.req, "replaced in its session")
        self._unpin(turn)
        turn.req.session_turn = None
        session.turns.pop(turn.rid, None)
