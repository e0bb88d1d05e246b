"""The scheduler's half of a disaggregated request, with scripted transfer agents: what each
side hands the agent, when a request answers, and that every ending (sent, lost, aborted)
leaves the pool whole."""

from __future__ import annotations

from test_scheduler import PAGE, assert_pool_full, final, make, run_until_idle

from cadence.disaggregation import messages as m
from cadence.disaggregation.agent import Arrived, Committed, Lost, Ready, Sent
from cadence.io_struct import AbortReq, SamplingParams, TokenizedGenerateReqInput
from cadence.scheduler.disaggregation import DecodeIntake, PrefillHandoff


class FakeAgent:
    """Records what the scheduler asks; the test decides what happens."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.events: list = []
        self.stored: list[tuple[list[int], object]] = []
        self.ready_done: dict[int, object] = {}

    @property
    def has_events(self) -> bool:
        return bool(self.events)

    def take_events(self):
        events, self.events = self.events, []
        for event in events:
            if isinstance(event, Ready):
                self.ready_done[event.room] = event.done
        return events

    def commit(self, room):
        """The prefill side confirms at once (tests queue a Lost where it does not)."""
        self.calls.append(("commit", room))
        self.events.append(Committed(room, self.ready_done.pop(room)))

    def __getattr__(self, name):
        if name in ("expect", "send", "finish", "drop", "claim"):
            return lambda *args: self.calls.append((name, *args))
        raise AttributeError(name)

    def store(self, pages, event):
        self.stored.append((list(pages), event.data))

    def stats(self):
        return {}

    def close(self):
        pass

    def named(self, name):
        return [c for c in self.calls if c[0] == name]


def request(rid, room, prompt_len=10, max_new=4, host="p", port=9):
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=list(range(3, 3 + prompt_len)),
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0),
        bootstrap_host=host,
        bootstrap_port=port,
        bootstrap_room=room,
    )


def prefill_side(**kw):
    s, runner, alloc = make(num_pages=16, disaggregation_mode="prefill", **kw)
    agent = FakeAgent()
    s.pd = PrefillHandoff(agent, s.kv)
    return s, runner, alloc, agent


def decode_side(**kw):
    s, runner, alloc = make(num_pages=16, disaggregation_mode="decode", **kw)
    agent = FakeAgent()
    s.pd = DecodeIntake(agent, s.kv, runner.context_len)
    return s, runner, alloc, agent


def test_the_prefill_half_sends_pages_as_chunks_finish_and_answers_once_sent():
    s, runner, alloc, agent = prefill_side(chunk=4)
    s.handle(request("a", room=5, prompt_len=10, max_new=8))
    assert agent.named("expect") == [("expect", 5, "a")]
    outputs = run_until_idle(s)
    # Chunks of 4 tokens: whole pages go out after each, the partial last page at the end.
    sends = agent.named("send")
    assert [(first, len(pages)) for _, _, first, pages in sends] == [(0, 1), (1, 1), (2, 1)]
    [(_, room, done)] = agent.named("finish")
    assert room == 5 and done.token == 20 and done.cached_tokens == 0  # 10 + position
    assert not [o for o in outputs if o.finished_reason], "it answers only once sent"
    assert s.kv.usage().num_in_use == 3  # its pages are held for the transfer
    agent.events.append(Sent(5))
    out = final(run_until_idle(s), "a")
    assert out.finished_reason == {"type": "length", "length": 1}
    assert out.new_ids == [20] and out.completion_tokens == 1
    assert all(not b.is_decode for b in runner.batches)  # the prefill half never decodes
    assert_pool_full(s, alloc)


def test_a_lost_room_or_an_abort_ends_the_prefill_half_and_frees_its_pages():
    s, _, alloc, agent = prefill_side()
    s.handle(request("a", room=1))
    s.handle(request("b", room=2))
    run_until_idle(s)
    agent.events.append(Lost(1, "the decode server went away"))
    out = final(run_until_idle(s), "a")
    assert out.finished_reason["status_code"] == 500
    assert "went away" in out.finished_reason["message"]
    s.handle(AbortReq(rid="b"))
    assert agent.named("drop")[-1][1] == 2
    assert_pool_full(s, alloc)


def test_a_room_in_use_is_refused():
    s, _, alloc, agent = prefill_side()
    s.handle(request("a", room=3))
    s.handle(request("b", room=3))
    out = final(s.step() + s.outputs, "b")
    assert out.finished_reason["status_code"] == 400 and "in use" in out.finished_reason["message"]
    agent.events.append(Sent(3))
    run_until_idle(s)
    assert_pool_full(s, alloc)


def test_the_decode_half_claims_stores_and_joins_with_the_first_token():
    s, runner, alloc, agent = decode_side()
    s.handle(request("a", room=7, prompt_len=10, max_new=4))
    s.step()
    [(_, room, rid, host, port, skip)] = agent.named("claim")
    assert (room, rid, host, port, skip) == (7, "a", "p", 9, 0)
    assert runner.batches == []  # never prefilled here
    pages = list(s._live()[0].pages)
    assert len(pages) == 3  # the prompt's pages, grown at admission
    agent.events += [
        Arrived(7, 0, 2, "chunk0"),
        Arrived(7, 2, 1, "chunk1"),
        Ready(7, m.Done(room=7, token=13, num_pages=3)),
    ]
    out = final(run_until_idle(s), "a")
    assert agent.stored == [(pages[:2], "chunk0"), (pages[2:3], "chunk1")]
    # The prefill's token, then 10 + position for each decoded one.
    assert out.new_ids == [13, 21, 22, 23] and out.finished_reason["type"] == "length"
    assert all(b.is_decode for b in runner.batches)
    assert runner.batches[0].items[0].start == 10  # decoding starts after the prompt
    assert_pool_full(s, alloc)


def test_the_decode_half_skips_what_its_cache_holds():
    s, _, alloc, agent = decode_side()
    s.handle(request("a", room=1, prompt_len=10, max_new=2))
    s.step()
    agent.events.append(Ready(1, m.Done(room=1, token=13)))
    run_until_idle(s)
    s.handle(request("b", room=2, prompt_len=10, max_new=2))  # the same prompt again
    s.step()
    assert agent.named("claim")[-1][-1] == 2  # two whole pages of the prompt are cached
    agent.events.append(Ready(2, m.Done(room=2, token=13)))
    run_until_idle(s)
    assert_pool_full(s, alloc)


def test_a_lost_room_or_an_abort_ends_the_decode_half_and_frees_its_pages():
    s, _, alloc, agent = decode_side()
    s.handle(request("a", room=1))
    s.handle(request("b", room=2))
    s.step()
    agent.events.append(Lost(1, "the prefill server went away"))
    out = final(run_until_idle(s), "a")
    assert out.finished_reason["status_code"] == 500
    s.handle(AbortReq(rid="b"))
    assert [c[1] for c in agent.named("drop")] == [2]
    # A chunk of a room already gone is released, never stored.
    released = []
    event = Arrived(2, 0, 1, "late", lambda: released.append(True))
    agent.events.append(event)
    run_until_idle(s)
    assert released == [True] and agent.stored == []
    assert_pool_full(s, alloc)


def test_max_new_tokens_zero_needs_no_decode_half():
    s, _, alloc, agent = decode_side()
    s.handle(request("a", room=1, max_new=0))
    out = final(run_until_idle(s), "a")
    assert out.finished_reason == {"type": "length", "length": 0} and agent.calls == []
    assert_pool_full(s, alloc)


def test_a_decode_request_waits_for_pages_then_claims():
    s, _, alloc, agent = decode_side()
    s.handle(request("big", room=1, prompt_len=40, max_new=20))  # 15 of 16 pages
    s.handle(request("next", room=2, prompt_len=8, max_new=4))
    s.step()
    assert [c[1] for c in agent.named("claim")] == [1]  # the second waits for memory
    agent.events.append(Ready(1, m.Done(room=1, token=50)))
    run_until_idle(s)
    assert [c[1] for c in agent.named("claim")] == [1, 2]
    agent.events.append(Ready(2, m.Done(room=2, token=11)))
    run_until_idle(s)
    assert_pool_full(s, alloc)
    assert PAGE == 4
