"""The ranks of a parallel model: the leader's runner, whose scheduler decides every step,
and the followers, which run each step the leader orders.

Rank 0 (`LeaderRunner`) wraps its `ModelRunner`: before each step (and each other call that
changes a runner's state) it broadcasts the order over the ranks' order group; every
follower (`follow`) receives it and makes the same call on its own share of the model, so
the collectives inside the forward pass meet. Followers never sample: the leader's results
are the server's. What a follower needs of a step is the batch without what only sampling
reads (grammars, penalties, seeds, adapters), so that is what travels.

With pipeline stages a decode is a lane: `launch` orders every rank to run its stage's
layers over it and send them on, and returns; the scheduler launches the next lane (other
requests) while later stages run this one, then `finish` orders the ranks to take it back
(the first stage's ranks receive the final rows and compute the logits; the leader
samples). Every rank launches and finishes lanes in the leader's order, and nothing else
runs through the stages while a lane is in flight.

A follower that cannot reach the leader (it died, or its server stopped) ends with an
error; the leader's next order to a follower that died fails the same way. Either way the
rank's process exits non-zero and its supervisor stops its server.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from cadence.model_executor.runner import EmbedItem, ItemResult, Launched, Runner, ScheduleBatch

logger = logging.getLogger("cadence.parallel")

# An idle leader orders a keep-alive this often (s): a follower that died is found out
# within it, and the followers' wait for orders never runs out.
KEEP_ALIVE_S = 1.0

RUN, EMBED, RELEASE, LOAD, KEEP_ALIVE, STOP = "run", "embed", "release", "load", "ping", "stop"
LAUNCH, FINISH = "launch", "finish"  # a decode lane of pipeline stages, begun then taken back


class RanksLost(BaseException):  # noqa: N818 (not an Exception: no request handler may keep it)
    """A step failed across ranks (a rank died, a collective timed out): the ranks no longer
    agree on what they ran, so the server cannot go on. It passes every per-request
    `except Exception` on its way out of the scheduler process, which then exits non-zero."""


def _for_followers(batch: ScheduleBatch) -> ScheduleBatch:
    """The batch as followers run it: the same rows, without what only sampling reads."""
    items = [
        dataclasses.replace(
            item,
            sampling=None if item.sampling is None else True,
            token_ids_logprob=None,
            logprob_targets=[],
            lora=None,
            future_row=None,
        )
        for item in batch.items
    ]
    return ScheduleBatch(batch.is_decode, items, batch.new_pages)


class LeaderRunner(Runner):
    """Rank 0's runner: the scheduler's, ordering every follower to do what it does."""

    def __init__(self, runner: Any):
        self.inner = runner
        self.groups = runner.groups
        self.lora = runner.lora
        self.context_len = runner.context_len
        self.eos_token_ids = runner.eos_token_ids
        self.is_generation = runner.is_generation
        self.embed_needs_kv = runner.embed_needs_kv
        self.kv_pool_bytes = runner.kv_pool_bytes
        self.is_kv_pool_committed = runner.is_kv_pool_committed
        # With pipeline stages, a decode keeps one lane per stage in flight.
        self.decode_lanes = runner.groups.layout.pp_size
        self._lanes_in_flight = 0
        self.lanes_launched = 0  # decode lanes launched since start
        self._last_order = time.monotonic()

    def __getattr__(self, name: str) -> Any:  # config, kv_pool, kv_allocator, platform, ...
        return getattr(self.inner, name)

    def _together(self, kind: str, payload: Any, call, *args) -> Any:
        """Orders every follower to do `kind`, then does it here. Any failure is fatal
        (`RanksLost`): the ranks may have stopped at different collectives."""
        try:
            self.groups.broadcast_order((kind, payload))
            self._last_order = time.monotonic()
            return call(*args) if call is not None else None
        except Exception as e:
            raise RanksLost(f"the ranks lost step with each other during {kind!r}: {e}") from e

    def _alone(self, kind: str) -> None:
        """A step that goes through the stages on its own: no lane may be in flight, or the
        stages would pair its sends with a lane's."""
        if self._lanes_in_flight:
            raise RuntimeError(f"{kind!r} ordered while {self._lanes_in_flight} lane(s) fly")

    def run(self, batch: ScheduleBatch) -> list[ItemResult]:
        self._alone(RUN)
        return self._together(RUN, _for_followers(batch), self.inner.run, batch)

    def launch(self, batch: ScheduleBatch) -> Launched:
        """A decode with pipeline stages returns once the first stage has sent it on: the
        scheduler launches the next lane (other requests) while the later stages run this
        one, and finishes the lanes in order. Any other step runs now."""
        if not self.inner.launches_lane(batch):
            return super().launch(batch)
        lane = self._together(LAUNCH, _for_followers(batch), self.inner.launch_lane, batch)
        self._lanes_in_flight += 1
        self.lanes_launched += 1
        return Launched(batch, None, lane)

    def finish(self, launched: Launched) -> list[ItemResult]:
        if launched.results is not None:
            return launched.results
        self._lanes_in_flight -= 1
        return self._together(FINISH, None, self.inner.finish_lane, launched.pending)

    def embed(self, items: list[EmbedItem]) -> list[list[float]]:
        self._alone(EMBED)
        return self._together(EMBED, items, self.inner.embed, items)

    def release_decode_state(self) -> None:
        if self.inner.has_decode_state:  # called at every idle step: only when there is some
            self._alone(RELEASE)
            self._together(RELEASE, None, self.inner.release_decode_state)

    def load_weights(self, model_path: str, load_format: str | None) -> str:
        self._alone(LOAD)
        # A file that cannot be served fails alike on every rank, before any collective.
        return self._together(LOAD, (model_path, load_format), self.inner.load_weights,
                              model_path, load_format)  # fmt: skip

    def keep_alive(self) -> None:
        if time.monotonic() - self._last_order >= KEEP_ALIVE_S:
            self._together(KEEP_ALIVE, None, None)

    def close(self) -> None:
        """Tells the followers to stop (the server is stopping), then leaves the groups."""
        try:
            self.groups.broadcast_order((STOP, None))
        except Exception as e:  # a follower already gone: nothing more to tell
            logger.warning("could not order the ranks to stop: %s", e)
        finally:
            self.groups.close()

    def embedding_facts(self) -> dict:
        return self.inner.embedding_facts()

    def make_generator(self, seed: int) -> Any:
        return self.inner.make_generator(seed)

    def skip_draws(self, generator: Any, num_tokens: int) -> None:
        self.inner.skip_draws(generator, num_tokens)

    def profiler_activities(self) -> list:
        return self.inner.profiler_activities()


def _listen(groups: Any, orders: queue.SimpleQueue) -> None:
    """Receives the leader's orders as they come, while the rank works on earlier ones: a
    broadcast returns on the leader only once every rank has joined it, so a rank busy with
    one lane's layers would otherwise hold the leader back from launching the next."""
    try:
        while True:
            order = groups.broadcast_order()
            orders.put(order)
            if order[0] == STOP:
                return
    except BaseException as e:  # the leader gone: the rank's loop raises it
        orders.put((_LOST, e))


_LOST = "lost"


def follow(runner: Any) -> None:
    """A follower rank's loop: every order the leader broadcasts, done on this rank's share,
    until it orders a stop. A failure (the leader gone, a collective timed out) raises."""
    orders: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(
        target=_listen, args=(runner.groups, orders), name="rank-orders", daemon=True
    ).start()
    lanes: deque = deque()  # launched, not yet finished, oldest first
    while True:
        kind, payload = orders.get()
        if kind == _LOST:
            raise RuntimeError(f"lost the leader rank's orders: {payload}") from payload
        if kind == LAUNCH:
            lanes.append(runner.launch_lane(payload))
        elif kind == FINISH:
            runner.finish_lane(lanes.popleft())
        elif kind == RUN:
            runner.run(payload)
        elif kind == EMBED:
            runner.embed(payload)
        elif kind == RELEASE:
            runner.release_decode_state()
        elif kind == LOAD:
            runner.load_weights(*payload)
        elif kind == STOP:
            return
        elif kind != KEEP_ALIVE:
            raise RuntimeError(f"unknown order {kind!r} from the leader rank")
