"""Prefill/decode disaggregation between two launched servers on this machine (shm relay).

The tests send each request to both halves at once with the same bootstrap fields, as a PD
router does (the router's own tests: test_pd_router_e2e.py), and compare with the shared
colocated server. Faults: a handshake that never happens, a stalled decode server, either
server killed mid-transfer; each ends in a clear error on the survivor within its
timeouts, with no page held afterwards, and the next request succeeds."""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_server import Server, free_port, is_idle, sse_events, tried
from pd_servers import PD_BOOTSTRAP_PORT, PD_TIMEOUTS

PROMPTS = [
    f"{subject} {verb}"
    for subject in (
        "The capital of France",
        "My favourite food",
        "A good way to learn Python",
        "The sky at night",
        "Rivers in Europe",
        "The history of computing",
        "A short poem about cats",
        "Three facts about the moon",
        "How bread is made",
        "The rules of chess",
    )
    for verb in (
        "is",
        "includes",
        "can be described as",
        "was",
        "starts with",
        "means",
        "matters because",
        "looks like",
        "has",
        "will be",
    )  # fmt: skip
]
GREEDY = {"max_new_tokens": 8, "temperature": 0}
LONG_PROMPT = " ".join(["The history of the Roman empire spans many centuries."] * 60)


def room() -> int:
    return random.randrange(2**63)


def pd_fields(port: int, r: int | None = None) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": r or room()}


def both(prefill: Server, decode: Server, body: dict, port: int, timeout: float = 60) -> tuple:
    """The body sent to both halves at once, as a router does: (prefill, decode) responses."""
    body = {**body, **pd_fields(port)}
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(httpx.post, srv.url + "/generate", json=body, timeout=timeout)
            for srv in (prefill, decode)
        ]
        return tuple(f.result() for f in futures)


def colocated(server: Server, body: dict) -> dict:
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def pair(prefill_server, decode_server):
    yield prefill_server, decode_server, PD_BOOTSTRAP_PORT
    for srv in (prefill_server, decode_server):
        assert is_idle(srv.wait_idle()), f"{srv.name} holds pages after the test"


def test_greedy_outputs_equal_a_colocated_server_single_and_concurrent(server, pair):
    prefill, decode, port = pair
    # 40 prompts here; the router's test (test_pd_router_e2e.py) runs all 100 through it.
    bodies = [{"text": p, "sampling_params": GREEDY} for p in PROMPTS[::5] + PROMPTS[1::5]]
    with ThreadPoolExecutor(8) as pool:
        want = list(pool.map(lambda b: colocated(server, b)["output_ids"], bodies))
    for body, expected in zip(bodies[:10], want):  # one at a time
        p, d = both(prefill, decode, body, port)
        assert p.status_code == d.status_code == 200, (p.text, d.text)
        assert d.json()["output_ids"] == expected, body["text"]
        assert p.json()["output_ids"] == expected[:1]  # the prefill half answers its one token
        assert p.json()["meta_info"]["finish_reason"]["type"] == "length"
    with ThreadPoolExecutor(16) as pool:  # all at once
        got = list(pool.map(lambda b: both(prefill, decode, b, port), bodies))
    for (_, d), expected, body in zip(got, want, bodies):
        assert d.status_code == 200, d.text
        assert d.json()["output_ids"] == expected, body["text"]


def test_a_long_prompt_moves_chunk_by_chunk_and_is_cached_on_both_sides(server, pair):
    prefill, decode, port = pair
    body = {"text": LONG_PROMPT, "sampling_params": GREEDY}
    expected = colocated(server, body)["output_ids"]
    for turn in range(2):  # the second time, both halves find the prompt in their caches
        p, d = both(prefill, decode, body, port)
        assert d.status_code == 200, d.text
        assert d.json()["output_ids"] == expected
        if turn:
            assert p.json()["meta_info"]["cached_tokens"] > 0
            assert d.json()["meta_info"]["cached_tokens"] == p.json()["meta_info"]["cached_tokens"]


def test_sampling_logprobs_stops_and_constraints_hold_across_the_halves(server, pair):
    prefill, decode, port = pair
    cases = [
        {"sampling_params": {**GREEDY, "max_new_tokens": 12, "stop": [","]}},
        {"sampling_params": {**GREEDY, "max_new_tokens": 6, "regex": "(yes|no), [0-9]+"}},
        {
            "sampling_params": GREEDY,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 0,
        },  # fmt: skip
        {"sampling_params": {**GREEDY, "max_new_tokens": 1}},
        {"sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "seed": 7}},
    ]
    for extra in cases:
        body = {"text": "Answer the question: is it sunny today?", **extra}
        expected = colocated(server, body)
        p, d = both(prefill, decode, body, port)
        assert d.status_code == 200, d.text
        got = d.json()
        assert got["output_ids"] == expected["output_ids"], extra
        assert got["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
        if extra.get("return_logprob"):
            want = expected["meta_info"]["output_token_logprobs"]
            have = got["meta_info"]["output_token_logprobs"]
            assert [t for _, t, _ in have] == [t for _, t, _ in want]
            assert have[0][0] == pytest.approx(want[0][0], abs=1e-3)  # the prefill's token
            assert len(got["meta_info"]["output_top_logprobs"][0]) == 2
            # The prompt's logprobs come from the prefill half (a router merges them).
            assert p.json()["meta_info"]["input_token_logprobs"]
    # max_new_tokens 0: the decode half has nothing to do; the prefill half runs the prompt.
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 0}}
    p, d = both(prefill, decode, body, port)
    assert p.status_code == d.status_code == 200 and d.json()["output_ids"] == []


def test_a_streamed_decode_half_starts_with_the_prefill_token(server, pair):
    prefill, decode, port = pair
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    expected = colocated(server, body)["text"]

    def streamed() -> list[str]:
        fields = pd_fields(port)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(
                httpx.post, prefill.url + "/generate", json={**body, **fields}, timeout=60
            )
            with httpx.stream(
                "POST",
                decode.url + "/generate",
                json={**body, **fields, "stream": True},
                timeout=60,
            ) as r:
                events = sse_events(r.iter_lines())
            assert first.result().status_code == 200
        return [e["text"] for e in events if e != "[DONE]"]

    texts = tried(streamed, lambda texts: len(texts) >= 2)
    assert texts[-1] == expected and len(texts) >= 2


def test_the_openai_routes_carry_the_bootstrap_fields(server, pair):
    prefill, decode, port = pair
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    expected = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    body = {**body, **pd_fields(port)}
    with ThreadPoolExecutor(2) as pool:
        p, d = pool.map(
            lambda s: httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60),
            (prefill, decode),
        )
    assert d.status_code == 200, d.text
    assert (
        d.json()["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    )
    assert d.json()["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]


def test_requests_without_a_room_are_refused_or_prefilled_locally_and_health_needs_no_peer(
    server, pair
):
    """A prefill server refuses a request without a room (400 naming bootstrap_room); the
    decode server, started with --disaggregation-decode-local-prefill, runs it whole itself
    (the colocated answer). Neither needs its peer for /health_generate."""
    prefill, decode, _ = pair
    body = {"text": "hi", "sampling_params": GREEDY}
    r = httpx.post(prefill.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and "bootstrap_room" in r.text
    r = httpx.post(decode.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == colocated(server, body)["output_ids"]
    for srv in (prefill, decode):
        assert httpx.get(srv.url + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(prefill.url + "/server_info", timeout=30).json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == pair[2]


def test_a_handshake_that_never_happens_fails_both_halves_within_the_timeout(pair):
    prefill, decode, port = pair
    body = {"text": "Hello", "sampling_params": GREEDY, **pd_fields(port)}
    for srv, words in ((decode, "bootstrap_room"), (prefill, "no decode server claimed")):
        started = time.monotonic()
        r = httpx.post(srv.url + "/generate", json={**body, "bootstrap_room": room()}, timeout=30)
        assert r.status_code == 500 and words in r.json()["error"]["message"], r.text
        assert time.monotonic() - started < 4 + 3  # the bootstrap timeout, and some
        assert is_idle(srv.wait_idle())
    # The pair is not sticky: the next request succeeds.
    p, d = both(prefill, decode, {"text": "Hello", "sampling_params": GREEDY}, port)
    assert d.status_code == 200, d.text


def test_a_stalled_decode_server_fails_both_halves_then_recovers(pair):
    prefill, decode, port = pair
    body = {"text": LONG_PROMPT, "sampling_params": GREEDY}
    scheduler = decode.child_pid("scheduler")
    fields = pd_fields(port)
    with ThreadPoolExecutor(2) as pool:
        d = pool.submit(httpx.post, decode.url + "/generate", json={**body, **fields}, timeout=60)
        time.sleep(0.5)  # the decode half has claimed its room
        os.kill(scheduler, signal.SIGSTOP)
        try:
            started = time.monotonic()
            p = httpx.post(prefill.url + "/generate", json={**body, **fields}, timeout=60)
            assert p.status_code == 500 and "bootstrap_room" in p.text, p.text
            assert time.monotonic() - started < 15 + 15  # the waiting timeout, then some
        finally:
            os.kill(scheduler, signal.SIGCONT)
        assert d.result().status_code == 500, d.result().text
    for srv in (prefill, decode):
        assert is_idle(srv.wait_idle())
    p, d = both(prefill, decode, {"text": "Hello", "sampling_params": GREEDY}, port)
    assert d.status_code == 200, d.text


def _pd_server(name: str, mode: str, port: int, *extra: str) -> Server:
    args = [
        *("--max-total-tokens", "8192", "--skip-warmup", "--chunked-prefill-size", "512"),
        *("--disaggregation-mode", mode, "--disaggregation-bootstrap-port", str(port)),
        *PD_TIMEOUTS,
        *extra,
    ]
    return Server(name, args).start()


def _two_free_ports() -> int:
    """A bootstrap port whose next port is free too (the torch backend's store)."""
    while True:
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def test_the_torch_backend_carries_the_pages_between_two_processes(server):
    port = _two_free_ports()
    torch_backend = ("--disaggregation-transfer-backend", "torch")
    servers = [_pd_server(f"pdt-{m}", m, port, *torch_backend) for m in ("prefill", "decode")]
    try:
        prefill, decode = (srv.wait_ready() for srv in servers)
        bodies = [{"text": p, "sampling_params": GREEDY} for p in PROMPTS[:40:8]]
        bodies.append({"text": LONG_PROMPT, "sampling_params": GREEDY})  # several chunks
        for body in bodies:
            p, d = both(prefill, decode, body, port)
            assert d.status_code == 200, d.text
            assert d.json()["output_ids"] == colocated(server, body)["output_ids"], body["text"]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda b: both(prefill, decode, b, port)[1], bodies))
        assert all(r.status_code == 200 for r in got)
        for srv in (prefill, decode):
            assert is_idle(srv.wait_idle())
    finally:
        for srv in servers:
            if srv.proc is not None and srv.proc.poll() is None:
                srv.stop()
            srv.destroy()


def _kill(srv: Server) -> None:
    for pid in [srv.child_pid("scheduler"), srv.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    srv.wait_exit(10)


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_server_killed_mid_transfer_leaves_its_survivor_clean(victim):
    port = free_port()
    servers = {m: _pd_server(f"pd-{m}-{victim}", m, port) for m in ("prefill", "decode")}
    try:
        for srv in servers.values():
            srv.wait_ready()
        # ~2,400 tokens: seconds of prefill on any machine here (600 took 0.6 s on a fast one,
        # so the kill below came after the answer), while the timeouts stay well ahead.
        body = {"text": LONG_PROMPT * 4, "sampling_params": GREEDY, **pd_fields(port)}
        survivor = servers["decode" if victim == "prefill" else "prefill"]
        with ThreadPoolExecutor(2) as pool:
            futures = {
                m: pool.submit(httpx.post, s.url + "/generate", json=body, timeout=60)
                for m, s in servers.items()
            }
            started = time.monotonic()
            time.sleep(0.8)  # both halves hold the room; the prompt is being computed
            _kill(servers[victim])
            r = futures["decode" if victim == "prefill" else "prefill"].result()
        assert r.status_code == 500 and "went away" in r.json()["error"]["message"], r.text
        assert time.monotonic() - started < 8  # well within the timeouts: the loss is seen
        assert is_idle(survivor.wait_idle())
        # A new partner on the same port: the survivor serves the next request.
        servers[victim].destroy()
        servers[victim] = _pd_server(f"pd-{victim}-again", victim, port).wait_ready()
        p, d = both(
            servers["prefill"], servers["decode"], {"text": "Hi", "sampling_params": GREEDY}, port
        )
        assert p.status_code == d.status_code == 200, (p.text, d.text)
        for srv in servers.values():
            assert is_idle(srv.wait_idle())
    finally:
        for srv in servers.values():
            if srv.proc is not None and srv.proc.poll() is None:
                srv.stop()
            srv.destroy()
