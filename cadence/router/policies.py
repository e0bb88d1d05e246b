"""Routing policies: which of the fitting workers gets a request."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from cadence.router.config import RouterConfig
from cadence.router.kv_index import KvEventIndex
from cadence.router.radix_tree import PrefixTree
from cadence.router.request_meta import RouteMeta
from cadence.router.workers import Worker


class RoutingPolicy(ABC):
    """Chooses one worker for a request.

    Invariants:
    - `select` is called with a non-empty sequence of candidates, every one routable and
      able to serve the request, in a stable order (the order workers were added);
      it returns one of them.
    - A policy reads `Worker.active` but never mutates a worker: the router counts the
      request on the chosen worker after `select` returns and releases it itself.
    - A policy may keep its own state (counters, a prefix tree). All calls come from the
      router's event loop thread, so that state needs no lock.
    - `remove_worker` is called when a worker leaves the registry; a policy drops what it
      keeps about it.
    """

    name: ClassVar[str]

    @abstractmethod
    def select(self, candidates: Sequence[Worker], meta: RouteMeta) -> Worker:
        """Pick one of `candidates` for the request described by `meta`."""

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that was removed (nothing to forget by default)."""


class RoundRobinPolicy(RoutingPolicy):
    """Each candidate in turn; deterministic, so tests can predict it."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Worker], meta: RouteMeta) -> Worker:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker


class LeastRequestPolicy(RoutingPolicy):
    """Fewest active requests; ties go round robin."""

    name = "least_request"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Worker], meta: RouteMeta) -> Worker:
        worker = least_loaded(candidates, self._next)
        self._next += 1
        return worker


class RandomPolicy(RoutingPolicy):
    """Uniformly random."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], meta: RouteMeta) -> Worker:
        return candidates[self._rng.randrange(len(candidates))]


class PowerOfTwoPolicy(RoutingPolicy):
    """Two distinct random candidates; the one with fewer active requests wins."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], meta: RouteMeta) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        return b if b.active < a.active else a


class CacheAwarePolicy(RoutingPolicy):
    """Send a prompt where its prefix was sent before, unless the load is too uneven.

    1. Imbalanced (busiest - idlest > abs threshold and busiest > rel threshold x idlest):
       the least loaded worker.
    2. Otherwise the worker that saw the longest prefix of the prompt, when that prefix
       is at least `cache_threshold` of the prompt (least loaded among equals).
    3. Otherwise the least loaded worker.
    The prompt is then recorded in the tree for the chosen worker.

    Where workers publish KV-cache events (`kv_index`, set by the router) and the request's
    token ids are known, step 2 reads what each worker's cache really holds instead of the
    tree: the worker holding the longest run of the prompt's pages wins (least loaded
    among equals), and with no overlap anywhere the least loaded worker.
    """

    kv_index: KvEventIndex | None = None

    name = "cache_aware"

    def __init__(self, config: RouterConfig) -> None:
        self.cache_threshold = config.cache_threshold
        self.balance_abs_threshold = config.balance_abs_threshold
        self.balance_rel_threshold = config.balance_rel_threshold
        self.tree = PrefixTree(config.max_tree_size)
        self._next = 0

    def select(self, candidates: Sequence[Worker], meta: RouteMeta) -> Worker:
        self._next += 1
        text = meta.prefix_text
        overlaps = self._overlaps(candidates, meta)
        if self._is_imbalanced(candidates) or (not text and overlaps is None):
            worker = least_loaded(candidates, self._next)
        elif overlaps is not None:
            best = max(overlaps.values(), default=0)
            owners = [w for w in candidates if best and overlaps.get(w.id) == best]
            worker = least_loaded(owners or candidates, self._next)
        else:
            matched, owners = self.tree.match(text, [w.id for w in candidates])
            if owners and matched >= self.cache_threshold * len(text):
                worker = least_loaded([w for w in candidates if w.id in owners], self._next)
            else:
                worker = least_loaded(candidates, self._next)
        if text:
            self.tree.insert(text, worker.id)
        return worker

    def remove_worker(self, worker_id: str) -> None:
        self.tree.remove_tenant(worker_id)
        if self.kv_index is not None:
            self.kv_index.forget(worker_id)

    def _overlaps(self, candidates: Sequence[Worker], meta: RouteMeta) -> dict[str, int] | None:
        """Leading pages of the prompt each candidate holds, by their KV events; None when
        the events (or the prompt's tokens) are not there to tell."""
        if self.kv_index is None or not meta.token_ids:
            return None
        ids = [w.id for w in candidates]
        if not self.kv_index.knows(ids):
            return None
        return self.kv_index.overlaps(ids, meta.token_ids)

    def _is_imbalanced(self, candidates: Sequence[Worker]) -> bool:
        loads = [w.active for w in candidates]
        busiest, idlest = max(loads), min(loads)
        return (
            busiest - idlest > self.balance_abs_threshold
            and busiest > idlest * self.balance_rel_threshold
        )


def least_loaded(candidates: Sequence[Worker], turn: int) -> Worker:
    """The candidate with fewest active requests; `turn` rotates among ties."""
    fewest = min(w.active for w in candidates)
    tied = [w for w in candidates if w.active == fewest]
    return tied[turn % len(tied)]


def make_policy(config: RouterConfig, name: str | None = None) -> RoutingPolicy:
    """The policy named `name` (default: `config.policy`), tuned by `config`."""
    name = name or config.policy
    if name == "cache_aware":
        return CacheAwarePolicy(config)
    simple = {
        "round_robin": RoundRobinPolicy,
        "least_request": LeastRequestPolicy,
        "random": RandomPolicy,
        "power_of_two": PowerOfTwoPolicy,
    }
    if name not in simple:
        raise ValueError(f"policy: unknown policy {name!r}")
    return simple[name]()
