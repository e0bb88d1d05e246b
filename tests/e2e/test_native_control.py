"""Control routes against the shared launched server: abort, flush, pause/continue in each
mode, weight reload from disk and the profiler. Every test leaves the server idle and
unpaused, and checks it through /v1/loads."""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import httpx
import pytest
from e2e_server import is_idle, sse_events, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]
LONG = {"max_new_tokens": 4000, "ignore_eos": True}


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c
    c = server.client()
    c.post("/continue_generation")  # never leave the shared server paused
    c.close()
    assert is_idle(server.wait_idle()), "a request outlived its test"


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        yield ex


def post_later(pool, server, body, timeout=120):
    return pool.submit(lambda: httpx.post(server.url + "/generate", json=body, timeout=timeout))


def wait_running(server, n: int, min_tokens: int = 0, timeout: float = 60) -> dict:
    """Waits until n requests run (and hold at least min_tokens KV tokens)."""
    last = {}

    def ok():
        nonlocal last
        last = server.load()
        return last["num_running_reqs"] == n and last["num_used_tokens"] >= min_tokens

    assert wait_until(ok, timeout), f"never saw {n} running requests: {last}"
    return last


# ---- abort ------------------------------------------------------------------------------


def test_abort_one_rid_mid_stream_leaves_the_other_running(server, client, pool):
    body = {"text": PROMPTS[0], "sampling_params": LONG, "stream": True}
    with (
        client.stream("POST", "/generate", json={**body, "rid": "to-abort"}) as doomed,
        client.stream("POST", "/generate", json={**body, "rid": "to-keep"}) as kept,
    ):
        doomed_lines, kept_lines = doomed.iter_lines(), kept.iter_lines()
        for lines in (doomed_lines, kept_lines):
            assert next(line for line in lines if line).startswith("data: {")
        r = client.post("/abort_request", json={"rid": "to-abort"})
        assert r.status_code == 200
        events = sse_events(doomed_lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        assert events[-2]["meta_info"]["id"] == "to-abort"
        # The other request still runs: one more chunk arrives after the abort.
        assert next(line for line in kept_lines if line).startswith("data: {")
        assert server.load()["num_running_reqs"] == 1
        client.post("/abort_request", json={"rid": "to-keep"})
        assert sse_events(kept_lines)[-1] == "[DONE]"


def test_abort_all_ends_every_request(server, client, pool):
    futures = [post_later(pool, server, {"text": p, "sampling_params": LONG}) for p in PROMPTS]
    wait_running(server, 2)
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    for f in futures:
        r = f.result(timeout=30)
        assert r.status_code == 200
        assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert is_idle(server.wait_idle(2))


def test_abort_all_under_32_concurrent_requests_ends_each_with_an_aborted_finish(server, client):
    """SGLang's TestAbortAll: 32 long requests (half of them streams), then abort_all; each
    one ends with finish_reason abort and HTTP 200, none with an error or a broken stream."""

    def plain(i: int) -> tuple[int, dict]:
        body = {"text": PROMPTS[i % 2], "sampling_params": LONG}
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        return r.status_code, r.json()

    def stream(i: int) -> tuple[int, dict]:
        body = {"text": PROMPTS[i % 2], "sampling_params": LONG, "stream": True}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]", events[-3:]
        return r.status_code, events[-2]

    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        futures = [ex.submit(stream if i % 2 else plain, i) for i in range(32)]

        def all_in() -> bool:
            load = server.load()
            return load["num_running_reqs"] + load["num_waiting_reqs"] == 32

        assert wait_until(all_in, 60), server.load()
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        for f in futures:
            status, last = f.result(timeout=60)
            assert status == 200, last
            assert last["meta_info"]["finish_reason"]["type"] == "abort", last
            assert {"text", "output_ids"} <= last.keys()
    assert is_idle(server.wait_idle(5))


def test_abort_request_needs_a_rid_or_abort_all(client):
    r = client.post("/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


# ---- flush ------------------------------------------------------------------------------


def test_flush_cache_when_idle_and_refused_while_running(server, client, pool):
    assert client.post("/flush_cache").status_code == 200
    future = post_later(
        pool, server, {"text": PROMPTS[0], "sampling_params": LONG, "rid": "flush-busy"}
    )
    wait_running(server, 1)
    busy = client.post("/flush_cache")
    assert busy.status_code == 400
    assert "running" in busy.json()["error"]["message"]
    client.post("/abort_request", json={"rid": "flush-busy"})
    assert future.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert is_idle(server.wait_idle(2))
    assert client.post("/flush_cache").status_code == 200


# ---- pause / continue ---------------------------------------------------------------------


def reference(client, max_new_tokens: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    return [
        o["output_ids"]
        for o in client.post("/generate", json={"text": PROMPTS, "sampling_params": params}).json()
    ]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_then_continue_completes_with_the_same_output(server, client, pool, mode):
    expected = reference(client, 40)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    future = post_later(pool, server, {"text": PROMPTS, "sampling_params": params})
    wait_running(server, 2)
    r = client.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200 and r.json()["success"] is True
    paused = server.load()
    if mode == "retract":  # back in the queue, KV released
        assert paused["num_running_reqs"] == 0 and paused["num_waiting_reqs"] == 2
        assert paused["num_used_tokens"] == 0
    else:  # kept in place with their KV
        assert paused["num_running_reqs"] == 2 and paused["num_used_tokens"] > 0
    assert not wait_until(future.done, timeout=1.5), "generation went on while paused"
    still = server.load()
    for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens"):
        assert still[key] == paused[key], key
    assert client.post("/continue_generation").status_code == 200
    result = future.result(timeout=120)
    assert result.status_code == 200
    out = result.json()
    assert [o["meta_info"]["finish_reason"] for o in out] == [{"type": "length", "length": 40}] * 2
    assert [o["output_ids"] for o in out] == expected


def test_pause_abort_mode_ends_requests_and_holds_new_ones(server, client, pool):
    running = post_later(pool, server, {"text": PROMPTS[0], "sampling_params": LONG})
    wait_running(server, 1)
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    r = running.result(timeout=30)
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    held = post_later(pool, server, {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 3}})
    assert not wait_until(held.done, timeout=1.5), "a request ran while generation was paused"
    assert server.load()["num_waiting_reqs"] == 1
    assert client.post("/continue_generation").status_code == 200
    assert held.result(timeout=60).json()["meta_info"]["completion_tokens"] >= 1


def test_pause_rejects_an_unknown_mode(client):
    r = client.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"


# ---- weights and profiler ------------------------------------------------------------------


def test_update_weights_from_disk_same_model_then_bad_path(client):
    model_path = client.get("/model_info").json()["model_path"]
    params = {"temperature": 0, "max_new_tokens": 8}
    before = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": params}).json()[
        "output_ids"
    ]
    r = client.post("/update_weights_from_disk", json={"model_path": model_path}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    after = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": params}).json()[
        "output_ids"
    ]
    assert after == before

    bad = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent/model.gguf"})
    assert bad.status_code == 400
    assert bad.json()["success"] is False and "/nonexistent/model.gguf" in bad.json()["message"]
    missing = client.post("/update_weights_from_disk", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model_path"
    still = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": params}).json()[
        "output_ids"
    ]
    assert still == before, "a failed reload keeps the old weights"


def test_profile_writes_a_trace_into_the_given_directory(client, server, tmp_path):
    out_dir = Path(server.profile_dir) / "traces"  # a subdirectory of the server's --profile-dir
    assert client.post("/stop_profile").status_code == 400  # nothing to stop yet
    for path in (str(tmp_path / "traces"), "../traces", "a/b"):  # a client never names a path
        r = client.post("/start_profile", json={"output_dir": path})
        assert r.status_code == 400 and r.json()["error"]["param"] == "output_dir", r.text
    r = client.post("/start_profile", json={"output_dir": "traces"})
    assert r.status_code == 200 and r.json()["success"] is True
    assert (
        client.post("/start_profile", json={"output_dir": "traces"}).status_code == 400
    )  # one at a time
    client.post("/generate", json={"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 3}})
    r = client.post("/stop_profile", timeout=300)
    assert r.status_code == 200 and r.json()["success"] is True
    traces = [p for p in out_dir.iterdir() if p.is_file()]
    assert len(traces) == 1 and str(traces[0]) in r.json()["message"]
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events), (
        "the trace recorded the forward pass"
    )
    assert os.path.getsize(traces[0]) > 0


def test_profile_with_start_step_skips_that_many_steps_then_stops_by_itself(client, server):
    out_dir = Path(server.profile_dir) / "later"
    r = client.post("/start_profile", json={"output_dir": "later", "start_step": 2, "num_steps": 2})
    assert r.status_code == 200 and "after 2 forward steps" in r.json()["message"], r.text
    assert not list(out_dir.iterdir())  # armed: nothing recorded before its steps
    params = {"max_new_tokens": 8, "ignore_eos": True}
    client.post("/generate", json={"text": PROMPTS[0], "sampling_params": params})
    assert wait_until(lambda: list(out_dir.iterdir()), 60), "no trace after the profiled steps"
    assert client.post("/stop_profile").status_code == 400  # it stopped by itself
    # Armed, then stopped before its first step: no trace, and a new profile may start.
    assert client.post(
        "/start_profile", json={"output_dir": "never", "start_step": 10**6}
    ).is_success
    stopped = client.post("/stop_profile")
    assert stopped.status_code == 200 and "before it started" in stopped.json()["message"]
    assert not list((Path(server.profile_dir) / "never").iterdir())


# ---- a control message that fails, fails alone ------------------------------------------


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/open_session", {"capacity_of_str_len": 10**23}, "capacity_of_str_len"),
        ("/open_session", {"capacity_of_str_len": -1}, "capacity_of_str_len"),
        ("/start_profile", {"num_steps": 10**23}, "num_steps"),
        ("/start_profile", {"start_step": 10**23}, "start_step"),
        ("/start_profile", {"start_step": -1}, "start_step"),
    ],
)
def test_an_out_of_range_integer_is_a_400_and_the_next_control_answers_at_once(
    client, route, body, param
):
    """An integer above 2^64 used to fail in the message codec: a 500, and a reply waiter
    left behind, so the next control of that kind waited 60 s for a 503."""
    for _ in range(3):  # each one used to strand one waiter
        r = client.post(route, json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if route == "/open_session":
        r = client.post(route, json={"capacity_of_str_len": 10}, timeout=10)
        assert r.status_code == 200, r.text
        assert client.post("/close_session", json={"session_id": r.json()}, timeout=10).is_success
    else:
        r = client.post(route, json={"output_dir": "after-bad", "num_steps": 1}, timeout=10)
        assert r.status_code == 200, r.text
        client.post(
            "/generate", json={"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
        )
        assert client.post("/stop_profile", timeout=10).status_code == 400  # ended by itself


def test_concurrent_controls_of_one_kind_each_get_their_own_answer(client, server, pool):
    """Ids, not arrival order, match answers to callers: eight sessions opened at once get
    eight distinct ids, each the one its caller named."""
    names = [f"concurrent-{i}" for i in range(8)]
    opened = list(
        pool.map(
            lambda name: httpx.post(
                server.url + "/open_session", json={"session_id": name}, timeout=10
            ),
            names,
        )
    )
    assert [r.json() for r in opened] == names, [r.text for r in opened]
    for name in names:
        assert client.post("/close_session", json={"session_id": name}).is_success
