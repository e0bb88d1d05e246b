"""The KV transfer agents on their own: a prefill agent and a decode agent in this process,
over real ZMQ sockets and the shm relay, moving pages between two small pools."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from cadence.disaggregation import messages as m
from cadence.disaggregation.agent import Arrived, Committed, Lost, Ready, Sent
from cadence.disaggregation.decode_agent import DecodeAgent
from cadence.disaggregation.prefill_agent import PrefillAgent
from cadence.mem_cache.kv_pool import KVPool

PAGE = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool(num_pages=64, dtype=torch.float32, head_dim=8) -> KVPool:
    p = KVPool(num_pages, PAGE, num_layers=3, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    for buf in p.kv_buffer:
        buf.zero_()
    return p


@pytest.fixture(params=["shared pool", "relay"])
def pair(request, monkeypatch):
    """A prefill and a decode agent; the prefill pool in shared memory (read where it lies),
    or kept private (pages through the relay's slots)."""
    if request.param == "relay":
        monkeypatch.setattr(PrefillAgent, "_share_pool", lambda self: None)
    src, dst = pool(), pool()
    for buf in src.kv_buffer:
        buf.normal_()
    port = free_port()
    timeouts = {"bootstrap_timeout": 1.0, "waiting_timeout": 3.0}
    prefill = PrefillAgent(src, "shm", "127.0.0.1", port, **timeouts)
    decode = DecodeAgent(dst, "shm", **timeouts)
    prefill.start()
    decode.start()
    yield prefill, decode, port
    decode.close()
    prefill.close()


def events(agent, until, timeout=8.0) -> list:
    """The agent's events until one satisfies `until`."""
    got: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += agent.take_events()
        if any(until(e) for e in got):
            return got
        time.sleep(0.01)
    raise AssertionError(f"no such event; got {got}")


def store_all(decode: DecodeAgent, got: list, pages: list[int]) -> m.Done:
    """What the decode scheduler does: writes each Arrived chunk, releases it, and once all
    are written asks the prefill side to confirm; the Done once confirmed."""
    ready = None
    for e in got:
        if isinstance(e, Arrived):
            decode.store(pages[e.first_page : e.first_page + e.num_pages], e)
            e.release()
        elif isinstance(e, Ready):
            ready = e
    assert ready is not None
    decode.commit(ready.room)
    [committed] = [e for e in events(decode, lambda e: isinstance(e, Committed | Lost))]
    assert isinstance(committed, Committed), committed
    return committed.done


def test_pages_move_in_chunks_and_the_first_token_follows(pair):
    prefill, decode, port = pair
    prefill.pages_per_chunk = 3  # several chunks for a small pool
    src_pages, dst_pages = [9, 4, 30, 2, 17, 5, 8], [1, 2, 3, 4, 5, 6, 7]
    prefill.expect(7, "r")
    decode.claim(7, "r", "127.0.0.1", port, skip_pages=0)
    prefill.send(7, 0, src_pages[:4])  # a chunk of prefill finished
    prefill.send(7, 4, src_pages[4:])
    prefill.finish(7, m.Done(room=7, token=42, logprob=-0.5, cached_tokens=3))
    got = events(decode, lambda e: isinstance(e, Ready))
    done = store_all(decode, got, dst_pages)
    assert (done.token, done.logprob, done.cached_tokens) == (42, -0.5, 3)
    assert sum(isinstance(e, Arrived) for e in got) >= 3
    if prefill.shared is not None:  # read where they lie: no bytes went through the relay
        assert all(e.source is not None and e.data is None for e in got if isinstance(e, Arrived))
    for a, b in zip(prefill.pool.kv_buffer, decode.pool.kv_buffer):
        assert torch.equal(a[:, :, src_pages], b[:, :, dst_pages])
    assert any(isinstance(e, Sent) for e in events(prefill, lambda e: isinstance(e, Sent)))
    # Every relay slot came back once the chunks were written.
    deadline = time.monotonic() + 5
    while prefill.relay.stats()["pending"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert prefill.relay.stats()["pending"] == 0
    assert prefill.num_rooms() == decode.num_rooms() == 0


def test_a_claim_before_its_request_and_cached_pages_skipped(pair):
    prefill, decode, port = pair
    decode.claim(11, "r", "127.0.0.1", port, skip_pages=2)  # the decode side has 2 pages
    time.sleep(0.2)  # the claim waits at the prefill server for its request
    prefill.expect(11, "r")
    prefill.send(11, 0, [3, 6, 9, 12])
    prefill.finish(11, m.Done(room=11, token=1))
    got = events(decode, lambda e: isinstance(e, Ready))
    arrived = [e for e in got if isinstance(e, Arrived)]
    assert [e.first_page for e in arrived] == [2] and arrived[0].num_pages == 2
    store_all(decode, got, [0, 0, 20, 21])
    for a, b in zip(prefill.pool.kv_buffer, decode.pool.kv_buffer):
        assert torch.equal(a[:, :, [9, 12]], b[:, :, [20, 21]])


def test_a_room_the_prefill_side_ended_is_not_confirmed(pair):
    """The prefill side dropped the room after its Done went out (its client left, its
    pages went to others): the decode side's copies may be anyone's, so it must not go on."""
    prefill, decode, port = pair
    prefill.expect(12, "r")
    decode.claim(12, "r", "127.0.0.1", port, 0)
    prefill.send(12, 0, [3, 6])
    prefill.finish(12, m.Done(room=12, token=1))
    got = events(decode, lambda e: isinstance(e, Ready))
    prefill.drop(12, "the client went away")  # before the decode side commits
    time.sleep(0.2)
    for e in got:
        if isinstance(e, Arrived):
            decode.store([1, 2][e.first_page : e.first_page + e.num_pages], e)
            e.release()
    decode.commit(12)
    ended = [e for e in events(decode, lambda e: isinstance(e, Committed | Lost))]
    assert isinstance(ended[-1], Lost) and "the client went away" in ended[-1].message
    assert decode.num_rooms() == 0


def test_unclaimed_rooms_and_unknown_rooms_time_out_on_both_sides(pair):
    prefill, decode, port = pair
    prefill.expect(1, "alone")  # nobody claims it
    decode.claim(2, "orphan", "127.0.0.1", port, 0)  # no request has it
    lost = [e for e in events(prefill, lambda e: isinstance(e, Lost)) if isinstance(e, Lost)]
    assert lost[0].room == 1 and "no decode server claimed" in lost[0].message
    lost = [e for e in events(decode, lambda e: isinstance(e, Lost)) if isinstance(e, Lost)]
    assert lost[0].room == 2 and "no request with bootstrap_room 2" in lost[0].message
    assert prefill.num_rooms() == decode.num_rooms() == 0


def test_a_prefill_server_that_is_not_there(pair):
    _, decode, _ = pair
    decode.claim(3, "r", "127.0.0.1", free_port(), 0)
    [lost] = [e for e in events(decode, lambda e: isinstance(e, Lost)) if isinstance(e, Lost)]
    assert "did not take bootstrap_room 3" in lost.message


def test_either_side_ending_a_room_tells_the_other(pair):
    prefill, decode, port = pair
    prefill.expect(5, "a")
    decode.claim(5, "a", "127.0.0.1", port, 0)
    time.sleep(0.3)
    decode.drop(5, "the client went away")
    [lost] = [e for e in events(prefill, lambda e: isinstance(e, Lost)) if isinstance(e, Lost)]
    assert lost.room == 5 and "the client went away" in lost.message
    prefill.expect(6, "b")
    decode.claim(6, "b", "127.0.0.1", port, 0)
    time.sleep(0.3)
    prefill.drop(6, "aborted on the prefill server")
    [lost] = [e for e in events(decode, lambda e: isinstance(e, Lost)) if isinstance(e, Lost)]
    assert lost.room == 6 and "aborted on the prefill server" in lost.message


def test_different_pools_are_refused_naming_both_layouts():
    port = free_port()
    prefill = PrefillAgent(pool(), "shm", "127.0.0.1", port, bootstrap_timeout=2, waiting_timeout=4)
    decode = DecodeAgent(pool(dtype=torch.bfloat16), "shm", bootstrap_timeout=2, waiting_timeout=4)
    prefill.start()
    decode.start()
    try:
        prefill.expect(9, "r")
        decode.claim(9, "r", "127.0.0.1", port, 0)
        [lost] = [e for e in events(decode, lambda e: isinstance(e, Lost)) if isinstance(e, Lost)]
        assert "float32" in lost.message and "bfloat16" in lost.message
        assert any(isinstance(e, Lost) for e in events(prefill, lambda e: isinstance(e, Lost)))
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_server_going_away_ends_its_claimed_rooms(pair):
    prefill, decode, port = pair
    prefill.expect(4, "r")
    decode.claim(4, "r", "127.0.0.1", port, 0)
    time.sleep(0.3)  # accepted: the decode side now waits for pages
    prefill.close()
    [lost] = [e for e in events(decode, lambda e: isinstance(e, Lost)) if isinstance(e, Lost)]
    assert "went away" in lost.message


def test_a_decode_server_going_away_ends_its_rooms_on_the_prefill_side(pair):
    prefill, decode, port = pair
    prefill.expect(8, "r")
    decode.claim(8, "r", "127.0.0.1", port, 0)
    time.sleep(0.3)
    decode.close()
    [lost] = [e for e in events(prefill, lambda e: isinstance(e, Lost)) if isinstance(e, Lost)]
    assert "went away" in lost.message


def test_a_taken_bootstrap_port_is_a_clear_start_up_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        agent = PrefillAgent(
            pool(), "shm", "127.0.0.1", port, bootstrap_timeout=1, waiting_timeout=1
        )
        with pytest.raises(RuntimeError, match=f"bootstrap port {port}"):
            agent.start()


def test_a_payload_packs_any_byte_range_as_a_split_copy_does():
    """The shm relay packs a large put in parts on several threads: every part, wherever it
    cuts a layer, holds the bytes of the whole packing at its place."""
    import random

    from cadence.disaggregation.agent import PagePayload

    src = pool()
    for buf in src.kv_buffer:
        buf.normal_()
    payload = PagePayload(src, [3, 9, 1, 14])
    whole = torch.empty(payload.nbytes, dtype=torch.uint8)
    payload.pack_into(whole)
    rng = random.Random(0)
    for _ in range(100):
        start = rng.randrange(payload.nbytes)
        end = rng.randrange(start + 1, payload.nbytes + 1)
        part = torch.zeros(payload.nbytes, dtype=torch.uint8)
        payload.pack_into(part, start, end)
        assert torch.equal(part[start:end], whole[start:end])
        assert not part[:start].any() and not part[end:].any()
