"""The server's life: 503 until loaded and warmed up, clean stops on SIGTERM and SIGINT, a
non-zero exit naming a child that died, no orphans after a SIGKILL of the front process,
the API key on every route but the health checks, and 429 beyond a bounded queue.

Each test here takes its own short-lived server apart (see conftest.py); those servers are
launched together with the shared one so their loads overlap.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest
from e2e_server import API_KEY, is_idle, sse_events, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

IDLE_STOP_WITHIN_S = 1.0  # an idle server: the front, the scheduler and the detokenizer
STOP_WITHIN_S = 8.0  # "within a few seconds", with room for a loaded 2-core machine


def assert_nothing_left(srv, within: float = 3.0) -> None:
    assert wait_until(lambda: not srv.leftover_pids(), within), f"orphans: {srv.leftover_pids()}"


# ---- start-up -----------------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(server):
    statuses = [s for _, s in server.health_history]
    assert statuses[-1] == 200
    assert 503 in statuses, f"never saw the loading phase: {server.health_history[:5]}"
    assert 200 not in statuses[:-1]
    first_503 = statuses.index(503)
    assert all(s == 503 for s in statuses[first_503:-1]), (
        "once bound, /health answers 503 until ready"
    )
    status, body = server.early_responses["/generate"]
    assert status == 503 and "starting" in body
    status, _ = server.early_responses["/health"]
    assert status == 503


# ---- stopping -----------------------------------------------------------------------------


class InFlight:
    """A long /generate running on a thread; `outcome` is what the client finally got."""

    def __init__(self, srv, stream: bool):
        self.body = {
            "text": "Hello",
            "stream": stream,
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        }
        self.url = srv.url + "/generate"
        self.outcome: httpx.Response | Exception | None = None
        self.events: list = []  # SSE payloads of a stream that ended properly
        self.streaming = threading.Event()  # a stream's first event has arrived
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as r:
                if self.body["stream"]:
                    lines = []
                    for line in r.iter_lines():
                        lines.append(line)
                        if line.startswith("data: "):
                            self.streaming.set()
                    self.events = sse_events(lines)
                else:
                    r.read()
                self.outcome = r
        except Exception as e:  # kept for the assertions; the thread always reports
            self.outcome = e
        self.done.set()


def assert_ended_with_503(req: InFlight, words: str) -> None:
    assert req.done.wait(5), "the request was left hanging"
    r = req.outcome
    assert isinstance(r, httpx.Response) and r.status_code == 503, r
    error = r.json()["error"]
    assert error["code"] == 503 and words in error["message"], error


def test_sigterm_with_requests_in_flight_stops_everything(sigterm_server):
    srv = sigterm_server
    assert len(srv.leftover_pids()) >= 3  # front, scheduler, detokenizer
    assert len(srv.socket_dirs()) == 1
    stream, plain = InFlight(srv, stream=True), InFlight(srv, stream=False)
    assert wait_until(lambda: srv.load()["num_running_reqs"] == 2, 30)
    # A stream stopped before its first token is an ordinary 503 (no SSE has begun); this
    # test is about a stream stopped mid-way.
    assert stream.streaming.wait(30), stream.outcome
    start = time.monotonic()
    srv.send_signal(signal.SIGTERM)
    code = srv.wait_exit(STOP_WITHIN_S)
    took = time.monotonic() - start
    assert code == 0, f"exit code {code} after {took:.1f}s\n{srv.log_tail()}"
    assert srv.socket_dirs() == [], "the socket directory must be removed"
    assert_nothing_left(srv, within=1.0)
    assert_ended_with_503(plain, "shutting down")
    assert stream.done.wait(5), "the client's stream was left hanging"
    assert stream.events[-1] == "[DONE]", stream.outcome
    error = stream.events[-2]["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]


def test_sigint_stops_everything(sigint_server):
    srv = sigint_server
    children = srv.children()
    assert len(children) >= 2
    start = time.monotonic()
    srv.send_signal(signal.SIGINT)
    code = srv.wait_exit(STOP_WITHIN_S)
    took = time.monotonic() - start
    assert code == 0, f"exit code {code} after {took:.1f}s\n{srv.log_tail()}"
    assert took < IDLE_STOP_WITHIN_S, f"an idle server took {took:.2f} s to stop"
    assert "leaked" not in srv.log_text(), srv.log_tail()
    assert srv.socket_dirs() == []
    assert_nothing_left(srv, within=1.0)


@pytest.mark.parametrize(
    "role,sig", [("scheduler", signal.SIGKILL), ("detokenizer", signal.SIGTERM)]
)
def test_a_dead_child_stops_the_server_non_zero_naming_it(request, role, sig):
    srv = request.getfixturevalue(f"kill_{role}_server")
    plain = InFlight(srv, stream=False)
    assert wait_until(lambda: srv.load()["num_running_reqs"] == 1, 30)
    os.kill(srv.child_pid(role), sig)
    code = srv.wait_exit(STOP_WITHIN_S)
    assert code not in (0, None), f"exit code {code}\n{srv.log_tail()}"
    log = srv.log_tail()
    assert f"the {role} process died" in log, log
    assert srv.socket_dirs() == []
    assert_nothing_left(srv, within=1.0)
    assert_ended_with_503(plain, f"the {role} process died")


def test_sigkill_of_the_front_leaves_no_orphans(kill_front_server):
    srv = kill_front_server
    children = [p for p in srv.leftover_pids() if p != srv.proc.pid]
    assert len(children) >= 2
    srv.send_signal(signal.SIGKILL)
    assert srv.wait_exit(5) == -signal.SIGKILL
    assert wait_until(lambda: not srv.leftover_pids(), 5), (
        f"children outlived the front: {srv.leftover_pids()}"
    )
    # Nobody was left to remove the socket directory; the next server started here sweeps it.
    (left,) = srv.socket_dirs()
    srv.start()
    try:
        assert wait_until(lambda: not os.path.exists(left), 60), f"{left} was not swept"
        assert wait_until(lambda: len(srv.socket_dirs()) == 1, 60)  # the new server's own
    finally:
        srv.stop(signal.SIGTERM, timeout=20)
    assert srv.socket_dirs() == []


def test_a_stopped_child_makes_the_server_unhealthy_fail_waiters_and_exit(stall_server):
    """SIGSTOP of the scheduler: no crash, no exit status, just no progress. The watchdog
    (--watchdog-timeout 3) notices: health turns unhealthy on both protocols, the waiting
    request fails with 503, and the server exits non-zero so an orchestrator restarts it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_support import target

    srv = stall_server
    plain = InFlight(srv, stream=False)
    assert wait_until(lambda: srv.load()["num_running_reqs"] == 1, 30)
    scheduler = srv.child_pid("scheduler")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target(srv)))
    assert (
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    os.kill(scheduler, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        statuses = []
        while time.monotonic() - stopped < 15:
            try:
                status = httpx.get(srv.url + "/health", timeout=1).status_code
            except (
                httpx.HTTPError
            ) as e:  # the server already closed its port: down counts as unhealthy
                status = type(e).__name__
            statuses.append((time.monotonic() - stopped, status))
            if status != 200 and srv.proc.poll() is not None:
                break
            time.sleep(0.1)
        unhealthy = [t for t, status in statuses if status != 200]
        assert unhealthy and unhealthy[0] < 3 + 2, (
            statuses,
            srv.log_tail(),
        )  # timeout + a check period + slack
        code = srv.wait_exit(STOP_WITHIN_S + 10)
        assert code not in (0, None), f"exit code {code}\n{srv.log_tail()}"
        assert "made no progress" in srv.log_tail() and "scheduler" in srv.log_tail()
        assert_ended_with_503(plain, "stopped making progress")
    finally:
        try:
            os.kill(scheduler, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert_nothing_left(srv, within=5.0)


def test_a_non_latin1_api_key_is_refused_at_start_up():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "cadence.launch_server", "--api-key", "ключ", "--disable-grpc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "api_key" in proc.stderr and "Latin-1" in proc.stderr, (
        proc.stderr
    )


# ---- API key --------------------------------------------------------------------------------

GUARDED = [
    ("GET", "/model_info"),
    ("GET", "/get_model_info"),
    ("GET", "/server_info"),
    ("GET", "/get_server_info"),
    ("GET", "/get_load"),
    ("GET", "/v1/loads"),
    ("POST", "/generate"),
    ("POST", "/tokenize"),
    ("POST", "/v1/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/detokenize"),
    ("POST", "/abort_request"),
    ("POST", "/flush_cache"),
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/update_weight_version"),
    ("GET", "/get_weight_version"),
    ("POST", "/configure_logging"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/no/such/route"),
]


def test_api_key_guards_every_route_but_health(api_key_server):
    srv = api_key_server
    with srv.client(timeout=30) as client:
        for method, route in GUARDED:
            for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
                r = client.request(
                    method,
                    route,
                    headers=headers,
                    json={"text": "hi"} if method == "POST" else None,
                )
                assert r.status_code == 401, (method, route, headers, r.status_code)
                assert r.json()["error"]["type"] == "authentication_error"
        assert client.get("/health").status_code == 200
        assert client.get("/health_generate").status_code == 200
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert client.get("/model_info", headers=auth).status_code == 200
        info = client.get("/server_info", headers=auth)
        assert info.status_code == 200 and API_KEY not in info.text
        r = client.post(
            "/generate", headers=auth, json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1


# ---- overload ---------------------------------------------------------------------------------


async def test_overload_beyond_the_queue_is_429(overload_server):
    srv = overload_server
    body = {"text": "Count slowly:", "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
        responses = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(12)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert (
        1 <= statuses.count(200) <= 4
    )  # one running + one queued, plus any that came after one finished
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["Retry-After"] == "1"
    refused = refused.json()["error"]
    assert refused["type"] == "rate_limit_error" and refused["code"] == 429
    for r in responses:
        if r.status_code == 200:
            assert r.json()["meta_info"]["completion_tokens"] == 48
    assert is_idle(srv.wait_idle())
    with srv.client() as client:  # the refusals left nothing behind: a new request runs
        assert client.post("/generate", json=body).status_code == 200
