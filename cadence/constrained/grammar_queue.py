"""Requests waiting for their grammar, and the compiled grammars they share.

A collaborator of the scheduler. A request with a constraint goes here instead of the
waiting queue (`submit`); a worker thread compiles its grammar while the batch goes on
(the engines release the GIL while compiling); each step the scheduler takes back the
requests whose grammar is ready (`ready`), each with a `Grammar` of its own, or with the
error that ends it. A grammar is compiled once per distinct key: requests with the same
key share one compilation, finished or still running, and finished ones stay cached
(least recently used first out, within a byte budget).

Only the scheduler's thread calls these methods; the worker threads only run
`backend.compile`. The backend itself is built on the worker too, at the first constraint
(binding an engine to a vocabulary takes a second or two): a server that never sees one
never pays for it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cadence.constrained.base import Grammar, GrammarBackend, GrammarKey, InvalidGrammar

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_COMPILE_TIMEOUT_S = 60.0


class GrammarTimeout(InvalidGrammar):
    """Compiling took longer than the queue allows (a constraint too large to serve)."""


@dataclass
class _Waiting:
    owner: Any
    key: GrammarKey
    future: Future
    deadline: float


class GrammarQueue:
    def __init__(
        self,
        name: str,
        make_backend: Callable[[], GrammarBackend],
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_workers: int = 1,
    ):
        self.name = name  # the engine's --grammar-backend name
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.cache_bytes = cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="cadence-grammar")
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._sizes: dict[GrammarKey, int] = {}  # bytes of each finished entry
        self._waiting: list[_Waiting] = []
        self.num_compiled = 0  # compilations started (cache misses)
        self.num_cache_hits = 0

    @property
    def backend(self) -> GrammarBackend:
        """The engine, built on first use (on whichever thread asks first)."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    self._backend = self._make_backend()
        return self._backend

    def _compile(self, key: GrammarKey) -> Any:
        return self.backend.compile(key)

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def owners(self) -> list[Any]:
        """The requests waiting, in arrival order."""
        return [w.owner for w in self._waiting]

    def submit(self, owner: Any, key: GrammarKey) -> None:
        """`owner` waits for the grammar of `key` (compiled now, or found in the cache)."""
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            self.num_compiled += 1
        else:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
        deadline = time.monotonic() + self.compile_timeout_s
        self._waiting.append(_Waiting(owner, key, future, deadline))

    def ready(self) -> list[tuple[Any, Grammar | Exception]]:
        """Takes out the requests whose grammar is compiled (with a fresh Grammar each) or
        failed or timed out (with the error), in arrival order."""
        if not self._waiting:
            return []
        now = time.monotonic()
        done, still = [], []
        for w in self._waiting:
            if w.future.done():
                done.append((w.owner, self._grammar(w)))
            elif now >= w.deadline:
                done.append((w.owner, self._timeout(w)))
            else:
                still.append(w)
        self._waiting = still
        if done:
            self._trim()
        return done

    def discard(self, owner: Any) -> None:
        """`owner` no longer waits (aborted); its grammar still finishes into the cache."""
        self._waiting = [w for w in self._waiting if w.owner is not owner]

    def wait(self, timeout: float) -> None:
        """Blocks up to `timeout` seconds until some waiting grammar is ready (the scheduler
        has nothing else to do)."""
        futures = [w.future for w in self._waiting]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals -------------------------------------------------------------------------

    def _grammar(self, w: _Waiting) -> Grammar | Exception:
        error = w.future.exception()
        if error is not None:
            self._forget(w.key, w.future)  # a later request tries again
            if not isinstance(error, InvalidGrammar):
                logger.error("compiling a %s failed", w.key.field, exc_info=error)
            return error
        compiled = w.future.result()
        if w.key not in self._sizes and self._cache.get(w.key) is w.future:
            try:
                self._sizes[w.key] = self.backend.compiled_size(compiled)
            except Exception:
                self._sizes[w.key] = 0
        try:
            return self.backend.new_grammar(compiled)
        except Exception as e:
            return e

    def _timeout(self, w: _Waiting) -> Exception:
        return GrammarTimeout(
            w.key.field,
            f"compiling it took longer than {self.compile_timeout_s:g} s; simplify the "
            "constraint (smaller repetition counts, fewer alternatives)",
        )

    def _forget(self, key: GrammarKey, future: Future) -> None:
        if self._cache.get(key) is future:
            del self._cache[key]
            self._sizes.pop(key, None)

    def _trim(self) -> None:
        """Drops the least recently used finished entries beyond the byte budget (never one
        a request still waits for)."""
        total = sum(self._sizes.values())
        if total <= self.cache_bytes:
            return
        in_use = {w.key for w in self._waiting}
        for key in list(self._cache):
            if total <= self.cache_bytes:
                break
            if key in self._sizes and key not in in_use:
                total -= self._sizes.pop(key)
                del self._cache[key]
