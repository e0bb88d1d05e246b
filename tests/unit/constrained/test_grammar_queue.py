"""GrammarQueue with a stand-in engine: one compilation per distinct grammar, shared while
in flight and cached after; requests come back in arrival order with a grammar of their
own, or with the error that ends them; a slow compile times out; the cache stays in budget."""

from __future__ import annotations

import threading
import time

import pytest

from cadence.constrained.base import Grammar, GrammarBackend, GrammarKey, InvalidGrammar
from cadence.constrained.grammar_queue import GrammarQueue, GrammarTimeout


class FakeGrammar(Grammar):
    def __init__(self, compiled):
        self.compiled = compiled

    def fill_mask(self, bitmask, row):
        pass

    def accept(self, token_id):
        return True

    def is_terminated(self):
        return False


class FakeBackend(GrammarBackend):
    name = "fake"

    def __init__(self, gate: threading.Event | None = None):
        self.gate = gate
        self.compiled: list[GrammarKey] = []

    @classmethod
    def check(cls, key):
        pass

    def compile(self, key):
        if self.gate is not None:
            self.gate.wait(5)
        self.compiled.append(key)
        if key.text == "bad":
            raise InvalidGrammar(key.field, "bad grammar")
        if key.text == "boom":
            raise RuntimeError("engine bug")
        return f"compiled:{key.text}"

    def new_grammar(self, compiled):
        return FakeGrammar(compiled)

    def compiled_size(self, compiled):
        return 100


def drain(queue: GrammarQueue, count: int, timeout: float = 5.0) -> list:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        queue.wait(0.05)
        out += queue.ready()
    return out


def test_one_compilation_per_grammar_shared_while_in_flight():
    gate = threading.Event()
    backend = FakeBackend(gate)
    queue = GrammarQueue("fake", lambda: backend)
    key = GrammarKey("regex", "a+")
    queue.submit("r1", key)
    queue.submit("r2", key)
    queue.submit("r3", GrammarKey("regex", "b+"))
    assert queue.ready() == [] and len(queue) == 3 and queue.owners == ["r1", "r2", "r3"]
    gate.set()
    done = drain(queue, 3)
    assert [owner for owner, _ in done] == ["r1", "r2", "r3"]
    g1, g2 = done[0][1], done[1][1]
    assert g1 is not g2 and g1.compiled == g2.compiled == "compiled:a+"  # own state, one compile
    queue.submit("r4", key)  # cached now
    assert [o for o, _ in drain(queue, 1)] == ["r4"]
    assert backend.compiled.count(key) == 1 and queue.num_cache_hits == 2
    queue.shutdown()


def test_failures_come_back_as_errors_and_are_not_cached():
    backend = FakeBackend()
    queue = GrammarQueue("fake", lambda: backend)
    queue.submit("bad", GrammarKey("json_schema", "bad"))
    queue.submit("boom", GrammarKey("json_schema", "boom"))
    done = dict(drain(queue, 2))
    assert isinstance(done["bad"], InvalidGrammar) and "bad grammar" in str(done["bad"])
    assert isinstance(done["boom"], RuntimeError)
    queue.submit("again", GrammarKey("json_schema", "bad"))
    drain(queue, 1)
    assert backend.compiled.count(GrammarKey("json_schema", "bad")) == 2
    queue.shutdown()


def test_a_slow_compile_times_out_and_a_discarded_request_is_forgotten():
    gate = threading.Event()
    queue = GrammarQueue("fake", lambda: FakeBackend(gate), compile_timeout_s=0.1)
    queue.submit("slow", GrammarKey("regex", "x"))
    queue.submit("gone", GrammarKey("regex", "x"))
    queue.discard("gone")
    time.sleep(0.15)
    done = queue.ready()
    assert [o for o, _ in done] == ["slow"] and isinstance(done[0][1], GrammarTimeout)
    assert "longer than 0.1 s" in str(done[0][1]) and len(queue) == 0
    gate.set()
    queue.shutdown()


def test_the_cache_keeps_within_its_byte_budget():
    queue = GrammarQueue("fake", FakeBackend, cache_bytes=250)  # two entries of 100 bytes
    for text in ("a", "b", "c", "d"):
        queue.submit(text, GrammarKey("regex", text))
        drain(queue, 1)
    assert sum(queue._sizes.values()) <= 250 and len(queue._cache) == 2
    assert GrammarKey("regex", "d") in queue._cache and GrammarKey("regex", "a") not in queue._cache
    queue.shutdown()


def test_the_engine_is_built_once_on_first_use():
    built = []

    def make():
        built.append(1)
        return FakeBackend()

    queue = GrammarQueue("fake", make)
    assert built == []
    for text in ("a", "b"):
        queue.submit(text, GrammarKey("regex", text))
    drain(queue, 2)
    assert built == [1]
    queue.shutdown()


@pytest.mark.parametrize("owner", [object()])
def test_wait_returns_at_once_when_nothing_waits(owner):
    queue = GrammarQueue("fake", FakeBackend)
    start = time.monotonic()
    queue.wait(1.0)
    assert time.monotonic() - start < 0.5
    queue.shutdown()
