"""The scheduler with constrained requests, a scripted runner and a stand-in grammar engine:
a request waits for its grammar without holding back the others, samples with it, advances
it by every token and ends when it is complete; compile failures, refused tokens and aborts
while compiling end that request alone, and the KV pool is full again afterwards."""

from __future__ import annotations

import threading
import time

from test_scheduler import (
    EOS,
    PAGE,
    CharTokenizer,
    ScriptedRunner,
    assert_pool_full,
    final,
    request,
)

from cadence.constrained.base import Grammar, GrammarBackend, InvalidGrammar
from cadence.constrained.grammar_queue import GrammarQueue
from cadence.io_struct import AbortReq
from cadence.mem_cache.allocator import PageAllocator
from cadence.mem_cache.kv_manager import KVManager
from cadence.scheduler.scheduler import Scheduler
from cadence.scheduler.stop_checker import StopChecker
from cadence.server_args import ServerArgs


class CountingGrammar(Grammar):
    """Complete after `length` tokens; refuses the token `refuse`."""

    def __init__(self, length: int, refuse: int | None = None):
        self.length, self.refuse = length, refuse
        self.accepted: list[int] = []

    def fill_mask(self, bitmask, row):
        pass

    def accept(self, token_id):
        if token_id == self.refuse:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self):
        return len(self.accepted) >= self.length


class GatedBackend(GrammarBackend):
    """Compiles when the gate opens; the regex's text is the grammar's length (or "bad")."""

    name = "gated"

    def __init__(self):
        self.gate = threading.Event()
        self.grammars: list[CountingGrammar] = []

    @classmethod
    def check(cls, key):
        pass

    def compile(self, key):
        self.gate.wait(5)
        if key.text == "bad":
            raise InvalidGrammar(key.field, "cannot compile this")
        return key.text

    def new_grammar(self, compiled):
        length, _, refuse = compiled.partition(":")
        grammar = CountingGrammar(int(length), int(refuse) if refuse else None)
        self.grammars.append(grammar)
        return grammar


def make():
    backend = GatedBackend()
    runner = ScriptedRunner()
    alloc = PageAllocator(16, PAGE)
    s = Scheduler(
        ServerArgs(page_size=PAGE, chunked_prefill_size=64),
        runner,
        KVManager.build(alloc),
        StopChecker(CharTokenizer(), {EOS}, runner.context_len),
        grammars=GrammarQueue("gated", lambda: backend),
    )
    return s, runner, alloc, backend


def step_until(s: Scheduler, done, max_steps=400) -> list:
    outputs = []
    for _ in range(max_steps):
        outputs += s.step()
        if done(outputs):
            return outputs
    raise AssertionError("never happened")


def finished(rid):
    return lambda outs: any(o.rid == rid and o.finished_reason for o in outs)


def test_a_request_waits_for_its_grammar_while_others_run():
    s, runner, alloc, backend = make()
    s.handle(request("c", max_new=10, regex="3"))
    s.handle(request("free", max_new=3))
    outputs = step_until(s, finished("free"))  # the compile is still held at the gate
    assert final(outputs, "free").finished_reason["type"] == "length"
    assert s.grammars.owners and s.grammars.owners[0].rid == "c" and s.has_work
    load = s.handle(__import__("cadence.io_struct").io_struct.GetLoadReqInput())
    assert load.num_waiting_reqs == 1
    backend.gate.set()
    outputs = step_until(s, finished("c"))
    out = final(outputs, "c")
    # The grammar was complete after 3 tokens: the request ends there, as a stop.
    assert out.finished_reason == {"type": "stop", "matched": out.new_ids[-1]}
    assert out.completion_tokens == 3 and backend.grammars[0].accepted == out.new_ids
    sampled = [i for b in runner.batches for i in b.items if i.rid == "c" and i.sampling]
    assert sampled and all(i.sampling.grammar is backend.grammars[0] for i in sampled)
    assert_pool_full(s, alloc)


def test_a_grammar_that_does_not_compile_ends_its_request_with_a_400():
    s, _, alloc, backend = make()
    backend.gate.set()
    s.handle(request("bad", regex="bad"))
    out = final(step_until(s, finished("bad")), "bad")
    assert out.finished_reason["status_code"] == 400
    assert "cannot compile this" in out.finished_reason["message"]
    assert_pool_full(s, alloc)


def test_a_refused_token_fails_that_request_alone():
    s, _, alloc, backend = make()
    backend.gate.set()
    s.handle(request("refused", max_new=5, regex="5:15"))  # the runner samples 10 + position
    s.handle(request("fine", max_new=5, regex="5"))
    outputs = step_until(s, lambda o: finished("refused")(o) and finished("fine")(o))
    assert final(outputs, "refused").finished_reason["status_code"] == 500
    assert final(outputs, "fine").finished_reason["type"] == "length"
    assert_pool_full(s, alloc)


def test_an_abort_while_compiling_ends_the_request_and_forgets_it():
    s, _, alloc, backend = make()
    s.handle(request("c", regex="3"))
    s.step()
    s.handle(AbortReq(rid="c"))
    assert not s.grammars.owners and not s.has_work
    assert final(s.step(), "c").finished_reason["type"] == "abort"
    backend.gate.set()
    time.sleep(0.05)
    assert s.step() == [] and not s.has_work
    assert_pool_full(s, alloc)
