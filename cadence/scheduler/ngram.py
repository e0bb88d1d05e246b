"""Draft tokens without a draft model (`--speculative-algorithm NGRAM`): n-gram matches.

Two sources; the one whose match is longer drafts (the request's own on a tie):
- prompt lookup: the longest suffix of the request's tokens (prompt and output, between the
  min and max match windows long) that occurred earlier in them; the tokens that followed
  that occurrence are the draft. Answers that quote, reformat or lightly edit their prompt
  (or repeat themselves) are drafted this way.
- a store of recent outputs shared by every request: each finished output's n-grams map to
  the tokens that followed them; a suffix of the request found there drafts those. Up to
  --speculative-ngram-max-bfs-breadth continuations are kept per n-gram: BFS drafts the most
  recent, PROB the most frequent. The store holds at most --speculative-ngram-capacity
  n-grams and forgets the least recently used first.

A match's length is the evidence behind its draft: a request's own one- or two-token match
is often chance, while four tokens that the store has seen followed by something are
usually followed by it again (docs/speculative.md has what letting the longer one draft
measured against the request's own drafting whenever it had a match).

Drafts are chains (one token per position). The verifier accepts a draft token exactly when
the token the request samples there equals it, so what a request outputs never depends on
its drafts: only how many tokens one forward step gives it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

STORE_MAX_KEY = 4  # longest n-gram the shared store keys (bounds its entries per token)
CANDIDATES = 64  # most recent earlier occurrences of the shortest match extended per lookup


@dataclass(frozen=True)
class NgramConfig:
    num_draft_tokens: int  # per step, counting the last verified token (SGLang's meaning)
    min_match_window: int
    max_match_window: int
    max_bfs_breadth: int
    match_type: str  # "BFS" (most recent continuation) or "PROB" (most frequent)
    branch_length: int  # longest continuation the store keeps
    capacity: int  # most n-grams in the store

    @property
    def max_draft(self) -> int:
        return self.num_draft_tokens - 1


class _Continuations:
    """What followed one n-gram: up to `breadth` token chains, with counts and recency."""

    __slots__ = ("chains",)

    def __init__(self) -> None:
        self.chains: dict[tuple[int, ...], list[int]] = {}  # chain -> [count, last seen]

    def add(self, chain: tuple[int, ...], tick: int, breadth: int) -> None:
        seen = self.chains.get(chain)
        if seen is not None:
            seen[0] += 1
            seen[1] = tick
            return
        if len(self.chains) >= breadth:  # forget the least recent
            del self.chains[min(self.chains, key=lambda c: self.chains[c][1])]
        self.chains[chain] = [1, tick]

    def best(self, by_count: bool) -> tuple[int, ...]:
        key = 0 if by_count else 1
        return max(self.chains, key=lambda c: (self.chains[c][key], self.chains[c][1]))


class NgramDrafter:
    """Drafts for the scheduler's decoding requests; see the module docstring."""

    def __init__(self, config: NgramConfig):
        self.config = config
        self._store: OrderedDict[tuple[int, ...], _Continuations] = OrderedDict()
        self._tick = 0

    @property
    def store_size(self) -> int:
        return len(self._store)

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """At most `limit` tokens likely to follow `tokens` (the request's prompt and output);
        [] when nothing matches."""
        limit = min(limit, self.config.max_draft)
        if limit <= 0 or len(tokens) < self.config.min_match_window + 1:
            return []
        own, own_match = self._lookup_own(tokens, limit)
        if own_match >= min(self.config.max_match_window, STORE_MAX_KEY):
            return own  # no key of the store is longer
        stored, stored_match = self._lookup_store(tokens, limit)
        return stored if stored_match > own_match else own

    def remember(self, tokens: list[int], start: int) -> None:
        """Adds what followed each n-gram of `tokens[start:]` (a finished request's output,
        with `start` tokens of context before it) to the shared store."""
        cfg = self.config
        lo = max(cfg.min_match_window, 1)
        hi = min(cfg.max_match_window, STORE_MAX_KEY)
        if lo > hi or cfg.capacity <= 0:
            return
        self._tick += 1
        store, tick, span = self._store, self._tick, cfg.branch_length
        for i in range(max(start, lo), len(tokens) - 1):
            chain = tuple(tokens[i : i + span])
            for n in range(lo, min(hi, i) + 1):
                key = tuple(tokens[i - n : i])
                entry = store.get(key)
                if entry is None:
                    entry = store[key] = _Continuations()
                else:
                    store.move_to_end(key)
                entry.add(chain, tick, cfg.max_bfs_breadth)
        while len(store) > cfg.capacity:
            store.popitem(last=False)

    def clear(self) -> None:
        """Forgets the shared store (a cache flush)."""
        self._store.clear()

    # ---- lookups ------------------------------------------------------------------------

    def _lookup_own(self, tokens: list[int], limit: int) -> tuple[list[int], int]:
        """The continuation of the longest earlier occurrence of a suffix of `tokens`, and
        that suffix's length (0: none)."""
        cfg = self.config
        arr = np.asarray(tokens, dtype=np.int64)
        n = len(arr)
        m = cfg.min_match_window
        # Starts p of earlier occurrences of the last m tokens, with something after them.
        hit = np.ones(n - m, dtype=bool)
        for j in range(m):
            hit &= arr[j : n - m + j] == arr[n - m + j]
        starts = np.flatnonzero(hit)
        if starts.size == 0:
            return [], 0
        best_len, best_start = 0, -1
        for p in starts[::-1][:CANDIDATES].tolist():  # the most recent first: it wins ties
            length = m
            while (
                length < cfg.max_match_window
                and p - (length - m) - 1 >= 0
                and tokens[p - (length - m) - 1] == tokens[n - 1 - length]
            ):
                length += 1
            if length > best_len:
                best_len, best_start = length, p
                if length >= cfg.max_match_window:
                    break
        follow = best_start + m
        return tokens[follow : follow + limit], best_len

    def _lookup_store(self, tokens: list[int], limit: int) -> tuple[list[int], int]:
        """The stored continuation of the longest suffix of `tokens` the store keys, and
        that suffix's length (0: none)."""
        cfg = self.config
        hi = min(cfg.max_match_window, STORE_MAX_KEY, len(tokens))
        for n in range(hi, max(cfg.min_match_window, 1) - 1, -1):
            key = tuple(tokens[-n:])
            entry = self._store.get(key)
            if entry is not None:
                self._store.move_to_end(key)
                return list(entry.best(cfg.match_type == "PROB")[:limit]), n
        return [], 0


# Tokens of a followed draft that must come true to end a wait: one alone is often chance.
RESUME_MATCHED = 2


@dataclass
class DraftPace:
    """One request's drafting pace: how many tokens to draft next, backing off while its
    drafts keep failing so that ordinary chat pays (almost) nothing for speculation (and
    drafting again as soon as a draft it follows meanwhile comes true), and how likely its
    next draft token is to be accepted (recent verify steps weigh most)."""

    length: int  # tokens drafted next time
    wait: int = 0  # decode steps left before the next draft
    misses: int = 0  # verify steps in a row that accepted nothing
    hits: float = 0.0  # draft tokens accepted, decayed
    breaks: float = 0.0  # drafts that broke before their end, decayed
    # A draft found but not verified (not worth it this step), checked against the tokens
    # the request samples instead, so its acceptance record goes on without verifying.
    shadow: list[int] = field(default_factory=list)
    shadow_matched: int = 0

    def accept_prob(self, prior: float) -> float:
        """The chance that a draft token is accepted once those before it were: accepted
        tokens over accepted tokens and breaks, with `prior` as two observations' worth."""
        return (self.hits + 2 * prior) / (self.hits + self.breaks + 2)

    def drafting(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        self.hits = 0.8 * self.hits + accepted
        self.breaks = 0.8 * self.breaks + (accepted < proposed)

    def follow(self, draft: list[int]) -> None:
        """Checks `draft` against the coming tokens instead of verifying it."""
        if not self.shadow:
            self.shadow, self.shadow_matched = list(draft), 0

    def sampled(self, token: int) -> None:
        """A token sampled without a draft: the draft being followed matched it or broke."""
        if not self.shadow:
            return
        proposed = self.shadow_matched + len(self.shadow)
        if token == self.shadow[0]:
            self.shadow.pop(0)
            self.shadow_matched += 1
            if self.wait and self.shadow_matched >= RESUME_MATCHED:
                # Backing off, and the request copies again: draft from the next step on
                # (its misses stand: if this was chance, the next miss waits longer).
                self.record(self.shadow_matched, self.shadow_matched)
                self.wait = 0
                self.length = max(self.length, self.shadow_matched + 2)
                self.shadow = []
                return
            if self.shadow:
                return
        self.record(proposed, self.shadow_matched)
        self.shadow = []

    def update(self, proposed: int, accepted: int, max_draft: int) -> None:
        """After a verify step of `proposed` drafts, `accepted` of them right."""
        self.record(proposed, accepted)
        self.shadow = []
        if accepted == 0:
            self.misses += 1
            self.wait = (1 << min(self.misses, 5)) - 1  # 1, 3, 7, ... 31 steps without
            self.length = max(2, self.length // 2)
            return
        self.misses = 0
        if accepted == proposed:
            self.length = min(max_draft, self.length * 2)
        else:
            self.length = min(max_draft, max(2, accepted + 2))
