"""Prefill/decode disaggregation behind a PD router: `cadence router --pd-disaggregation` and
SGLang's gateway SMG (over HTTP and over gRPC) in front of the shared prefill and decode
servers, compared with the shared colocated server.

Through our router: greedy outputs equal the colocated server's for the 100 prompts of
test_pd_e2e.py over native /generate and for half of them over the openai SDK (chat and
completions, streamed and not), one by one and 16 at a time; the prompt's logprobs come merged from the prefill half;
a client that leaves (mid-stream, or while the prompt is still being computed) leaves both
servers idle; a wrong bootstrap port fails clearly within the servers' timeouts. Through SMG
in PD mode, HTTP and gRPC workers: the same greedy outputs for ten prompts.

The routers and gateways run for the module, each in its own session, stopped and reaped by
its fixture's finalizer. After every test neither PD server holds a page.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from e2e_server import free_port, is_idle, sse_events, wait_until
from grpc_support import grpc_port
from pd_servers import PD_BOOTSTRAP_PORT, PD_TIMEOUTS
from test_pd_e2e import GREEDY, PROMPTS
from test_smg_gateway import Gateway, smg_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROUTER_READY_S = 60
SEQUENTIAL = 10  # of the 100 prompts, sent one by one; the others go 16 at a time
CONCURRENCY = 16
OPENAI_MODES = [("chat", False), ("chat", True), ("completion", False), ("completion", True)]
OPENAI_PROMPTS = PROMPTS[::2]  # 50 prompts, a quarter in each mode (2 cores: keep it short)
OPENAI_SEQUENTIAL = 4  # of those, one in each mode, sent one by one
# 600 tokens: two prefill chunks of the servers' 512. (Longer prompts risk the servers'
# waiting timeout on a busy 2-core machine: the prefill half may not finish in time.)
TWO_CHUNK_PROMPT = " ".join(["The history of the Roman empire spans many centuries."] * 60)
MEDIUM_PROMPT = " ".join(["A short poem about cats has four lines."] * 20)  # 200 tokens
# Ten prompts the openai test asked the colocated server as unstreamed chats
SMG_PROMPTS = OPENAI_PROMPTS[::4][:10]
# The PD servers' --disaggregation-bootstrap-timeout (conftest)
BOOTSTRAP_TIMEOUT_S = float(
    PD_TIMEOUTS[PD_TIMEOUTS.index("--disaggregation-bootstrap-timeout") + 1]
)


class RouterProcess:
    """One `python -m cadence.router` in its own session, on a free port."""

    def __init__(self, args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmpdir = tempfile.mkdtemp(prefix="cdt-pdrouter-")
        self.log_path = os.path.join(self.tmpdir, "router.log")
        self.args = args
        self.proc: subprocess.Popen | None = None

    def start(self) -> RouterProcess:
        command = [
            *(sys.executable, "-m", "cadence.router", "--host", "127.0.0.1"),
            *("--port", str(self.port), "--health-check-startup-interval-secs", "0.1"),
            *("--request-timeout-secs", "60", *self.args),
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def wait_ready(self) -> RouterProcess:
        """Until /ready is 200: a prefill and a decode worker are both routable."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                return httpx.get(self.url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_until(ready, ROUTER_READY_S, interval=0.1):
            raise RuntimeError(f"router not ready in {ROUTER_READY_S}s:\n{self.log_tail()}")
        return self

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 10 s; reaps it (never fails)."""
        if self.proc is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(10)
                    break
                except subprocess.TimeoutExpired:
                    continue
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def pd_router_args(prefill_url: str, decode_url: str, bootstrap_port: int) -> list[str]:
    return [
        *("--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port)),
        *("--decode", decode_url),
    ]


class PdGateway(Gateway):
    """`smg launch --pd-disaggregation` over one prefill and one decode worker (http:// or
    grpc:// URLs), the prefill worker with its bootstrap port."""

    def __init__(self, prefill_url: str, decode_url: str):
        super().__init__(decode_url)
        self.workers = [
            *("--pd-disaggregation", "--prefill", prefill_url, str(PD_BOOTSTRAP_PORT)),
            *("--decode", decode_url),
        ]

    def start(self, command: list[str]) -> PdGateway:
        args = [
            *(*command, "launch", *self.workers, "--host", "127.0.0.1", "--port", str(self.port)),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
            *("--policy", "round_robin", "--log-level", "info"),
            # No grace period at shutdown: nothing is in flight when its fixture stops it.
            *("--shutdown-grace-period-secs", "0"),
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=dict(os.environ, NO_COLOR="1"),
            )
        return self


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_router(request, prefill_server, decode_server) -> RouterProcess:
    # No retries: a pair that fails must fail the test, not pass on a second room.
    args = pd_router_args(prefill_server.url, decode_server.url, PD_BOOTSTRAP_PORT)
    router = RouterProcess([*args, "--retry-max-retries", "0"])
    request.addfinalizer(router.stop)
    return router.start().wait_ready()


@pytest.fixture(autouse=True)
def pd_idle(prefill_server, decode_server):
    yield
    for srv in (prefill_server, decode_server):
        assert is_idle(srv.wait_idle()), f"{srv.name} holds pages after the test"


@pytest.fixture(scope="module")
def model_id(prefill_server) -> str:
    return httpx.get(prefill_server.url + "/v1/models").json()["data"][0]["id"]


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def generate(url: str, body: dict) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def native(answer: dict) -> tuple:
    """A /generate answer as colocated()'s native tuple: (text, finish_reason, output_ids)."""
    return answer["text"], answer["meta_info"]["finish_reason"]["type"], answer["output_ids"]


_colocated: dict[tuple[str, str, str], tuple] = {}  # (server url, kind, prompt) -> answer


def colocated(server, kind: str, prompts: list[str], model: str = "default") -> list[tuple]:
    """The colocated server's greedy answer per prompt, asked once in the module: `native`
    over /generate as native() gives it (a completion of the prompt has the same text and
    finish reason), `chat` over the openai SDK's unstreamed chat as ask() gives it."""
    missing = [p for p in prompts if (server.url, kind, p) not in _colocated]
    with openai_client(server.url) as client, ThreadPoolExecutor(CONCURRENCY) as pool:

        def answer(prompt: str) -> tuple:
            if kind == "chat":
                return ask(client, model, prompt, "chat", False)
            got = generate(server.url, {"text": prompt, "sampling_params": GREEDY})
            return native(got)

        for prompt, got in zip(missing, pool.map(answer, missing)):
            _colocated[server.url, kind, prompt] = got
    return [_colocated[server.url, kind, p] for p in prompts]


def ask(client: openai.OpenAI, model: str, prompt: str, kind: str, stream: bool) -> tuple:
    """(text, finish_reason) of one greedy request; a stream's deltas joined."""
    kwargs = dict(model=model, max_tokens=GREEDY["max_new_tokens"], temperature=0, stream=stream)
    if kind == "chat":
        reply = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **kwargs
        )
        if not stream:
            return reply.choices[0].message.content, reply.choices[0].finish_reason
        chunks = [c.choices[0] for c in reply if c.choices]
        return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
    reply = client.completions.create(prompt=prompt, **kwargs)
    if not stream:
        return reply.choices[0].text, reply.choices[0].finish_reason
    chunks = [c.choices[0] for c in reply if c.choices]
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def assert_same_logprobs(got: list, want: list) -> None:
    """Logprob lists of [logprob, token_id, text] entries: the same tokens, within 1e-3."""
    assert [t[1] for t in got] == [t[1] for t in want]  # the same token ids, in order
    for (lp, token, *_), (expected, *_) in zip(got, want):
        if expected is None:  # the first prompt token has no logprob
            assert lp is None, token
        else:
            assert lp == pytest.approx(expected, abs=1e-3), token


# ---- greedy outputs through our router ----------------------------------------------------------


def test_native_generate_through_the_router_equals_the_colocated_server(
    server, prefill_server, decode_server, pd_router
):
    want = colocated(server, "native", PROMPTS)
    for prompt, expected in zip(PROMPTS[:SEQUENTIAL], want):  # one at a time
        body = {"text": prompt, "sampling_params": GREEDY}
        r = httpx.post(pd_router.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert native(r.json()) == expected, prompt
        assert r.json()["meta_info"]["completion_tokens"] == len(expected[2])
        assert r.headers["x-cadence-worker"] == decode_server.url
        assert r.headers["x-cadence-prefill-worker"] == prefill_server.url
    with ThreadPoolExecutor(CONCURRENCY) as pool:  # 16 at a time
        got = list(
            pool.map(
                lambda p: generate(pd_router.url, {"text": p, "sampling_params": GREEDY}),
                PROMPTS[SEQUENTIAL:],
            )
        )
    for prompt, answer, expected in zip(PROMPTS[SEQUENTIAL:], got, want[SEQUENTIAL:]):
        assert native(answer) == expected, prompt


def test_openai_routes_through_the_router_equal_the_colocated_server(server, pd_router, model_id):
    """Prompt i goes as OPENAI_MODES[i % 4] (chat or completion, streamed or not). What each
    must give: a chat, the colocated server's unstreamed chat answer; a completion, the
    colocated server's native answer to the same prompt."""
    jobs = [(p, *OPENAI_MODES[i % len(OPENAI_MODES)]) for i, p in enumerate(OPENAI_PROMPTS)]
    chats = [p for p, kind, _ in jobs if kind == "chat"]
    chat_answers = dict(zip(chats, colocated(server, "chat", chats, model_id)))
    texts = dict(zip(OPENAI_PROMPTS, colocated(server, "native", OPENAI_PROMPTS)))
    want = [chat_answers[p] if kind == "chat" else texts[p][:2] for p, kind, _ in jobs]
    with openai_client(pd_router.url) as routed:
        for job, expected in zip(jobs[:OPENAI_SEQUENTIAL], want):  # one at a time
            assert ask(routed, model_id, *job) == expected, job
        with ThreadPoolExecutor(CONCURRENCY) as pool:  # 16 at a time
            got = list(pool.map(lambda j: ask(routed, model_id, *j), jobs[OPENAI_SEQUENTIAL:]))
    for job, answer, expected in zip(jobs[OPENAI_SEQUENTIAL:], got, want[OPENAI_SEQUENTIAL:]):
        assert answer == expected, job


def test_the_prompts_logprobs_come_merged_from_the_prefill_half(server, pd_router):
    """Decode servers compute no prompt logprobs: the router puts the prefill half's list in
    front of the decode answer's (empty) one, unstreamed and in every streamed event."""
    bodies = [
        {"text": text, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
        for text in ("The capital of France is", "Rivers in Europe include", MEDIUM_PROMPT)
    ]
    wants = [generate(server.url, body)["meta_info"] for body in bodies]
    for body, want in zip(bodies, wants):
        got = generate(pd_router.url, body)["meta_info"]
        assert_same_logprobs(got["input_token_logprobs"], want["input_token_logprobs"])
        assert len(got["input_token_logprobs"]) == got["prompt_tokens"] == want["prompt_tokens"]
        assert_same_logprobs(got["output_token_logprobs"], want["output_token_logprobs"])
    stream = {**bodies[0], "stream": True}
    with httpx.stream("POST", pd_router.url + "/generate", json=stream, timeout=60) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert events and all(e["meta_info"]["input_token_logprobs"] for e in events)
    assert_same_logprobs(
        events[-1]["meta_info"]["input_token_logprobs"], wants[0]["input_token_logprobs"]
    )


# ---- short prompts prefilled where they decode (--pd-local-prefill-max-tokens) ---------------

LOCAL_MAX_TOKENS = 32  # the PROMPTS are at most 46 bytes: 16 tokens by the router's estimate


@pytest.fixture(scope="module")
def local_router(request, prefill_server, decode_server) -> RouterProcess:
    args = pd_router_args(prefill_server.url, decode_server.url, PD_BOOTSTRAP_PORT)
    local = ("--pd-local-prefill-max-tokens", str(LOCAL_MAX_TOKENS))
    router = RouterProcess([*args, *local, "--retry-max-retries", "0"])
    request.addfinalizer(router.stop)
    return router.start().wait_ready()


def test_short_prompts_are_prefilled_by_the_decode_server_alone_and_long_ones_are_not(
    server, prefill_server, decode_server, local_router, model_id
):
    """Conditional disaggregation: a prompt within --pd-local-prefill-max-tokens goes to the
    decode server alone (no prefill worker named in the answer, no room opened on the prefill
    server), with the colocated server's greedy answer, natively and over the openai SDK
    streamed; a longer prompt is disaggregated as usual; bootstrap fields a client sends with
    a short prompt are dropped rather than left waiting for a transfer."""
    prompts = PROMPTS[:8]
    want = colocated(server, "native", prompts)
    before = prefill_requests(prefill_server)
    for prompt, expected in zip(prompts, want):
        body = {"text": prompt, "sampling_params": GREEDY}
        if prompt is prompts[0]:  # a client's own room: dropped, never waited for
            body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}
        r = httpx.post(local_router.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert native(r.json()) == expected, prompt
        assert r.headers["x-cadence-worker"] == decode_server.url
        assert "x-cadence-prefill-worker" not in r.headers
    ids = list(range(100, 100 + LOCAL_MAX_TOKENS))  # exactly at the limit, counted as ids
    body = {"input_ids": ids, "sampling_params": GREEDY}
    r = httpx.post(local_router.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200 and "x-cadence-prefill-worker" not in r.headers, r.text
    chat = colocated(server, "chat", prompts[:2], model_id)
    with openai_client(local_router.url) as client:
        for prompt, expected in zip(prompts[:2], chat):
            assert ask(client, model_id, prompt, "chat", True) == expected, prompt
    assert prefill_requests(prefill_server) == before  # the prefill server saw none of them
    body = {"text": MEDIUM_PROMPT, "sampling_params": GREEDY}  # 200 tokens: disaggregated
    r = httpx.post(local_router.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-cadence-prefill-worker"] == prefill_server.url
    assert native(r.json()) == colocated(server, "native", [MEDIUM_PROMPT])[0]
    assert wait_until(lambda: prefill_requests(prefill_server) == before + 1, 30)


def prefill_requests(srv) -> float:
    """The server's `sglang:num_requests_total`: generation requests that ended there."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    name = "sglang:num_requests_total"
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


# ---- clients that leave ---------------------------------------------------------------------


LONG_STORY = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}


def _leave_mid_native_stream(router_url: str, decode_server) -> None:
    body = {"text": "Tell me a very long story.", "sampling_params": LONG_STORY, "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", router_url + "/generate", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: {")
        assert decode_server.load()["num_running_reqs"] == 1
    # leaving the block closes the connection mid-stream


def _leave_mid_openai_stream(router_url: str, decode_server) -> None:
    with openai_client(router_url) as c:
        stream = c.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Tell me a very long story."}],
            max_tokens=2000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _, _ in zip(range(3), stream):
            pass
        assert decode_server.load()["num_running_reqs"] == 1
        stream.close()


def _leave_while_the_prompt_runs(router_url: str, decode_server) -> None:
    """A raw connection closed as soon as the decode half holds the request, while the
    prefill half is still computing the prompt (600 tokens no cache holds)."""
    text = f"{time.time_ns()} {TWO_CHUNK_PROMPT}"
    body = json.dumps({"text": text, "sampling_params": LONG_STORY, "stream": True}).encode()
    port = int(router_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert wait_until(lambda: not is_idle(decode_server.load()), timeout=10)


@pytest.mark.parametrize(
    "leave",
    [_leave_mid_native_stream, _leave_mid_openai_stream, _leave_while_the_prompt_runs],
    ids=["mid_native_stream", "mid_openai_stream", "while_the_prompt_runs"],
)
def test_a_client_that_leaves_leaves_both_servers_idle(
    leave, prefill_server, decode_server, pd_router
):
    leave(pd_router.url, decode_server)
    for srv in (prefill_server, decode_server):
        assert wait_until(lambda s=srv: is_idle(s.load()), timeout=10), (srv.name, srv.load())


# ---- router faults --------------------------------------------------------------------------


def test_a_wrong_bootstrap_port_fails_clearly_within_the_timeouts(
    prefill_server, decode_server, pd_router
):
    """Nothing listens on the bootstrap port the router was given: the halves never meet,
    the prefill server gives up after its bootstrap timeout, and the client gets the
    router's 502 naming that side (no retries here, so it comes after one timeout). A
    streamed request fails the same way (the decode side sends nothing before its first
    token): the openai SDK raises the router's error."""
    wrong = free_port()
    args = pd_router_args(prefill_server.url, decode_server.url, wrong)
    router = RouterProcess([*args, "--retry-max-retries", "0"])

    def unstreamed() -> tuple[httpx.Response, float]:
        started = time.monotonic()
        r = httpx.post(
            router.url + "/generate", json={"text": "Hello", "sampling_params": GREEDY}, timeout=30
        )
        return r, time.monotonic() - started

    def streamed() -> None:
        with openai_client(router.url) as c, pytest.raises(openai.APIError, match="bootstrap"):
            for _ in c.completions.create(model="default", prompt="Hi", max_tokens=8, stream=True):
                pass

    try:
        router.start().wait_ready()
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.submit(unstreamed), pool.submit(streamed)
            r, elapsed = first.result()
            second.result()
    finally:
        router.stop()
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "bad_gateway" and error["role"] in ("prefill", "decode")
    assert error["worker"] in (prefill_server.url, decode_server.url)
    assert "bootstrap_room" in error["message"], error
    assert elapsed < BOOTSTRAP_TIMEOUT_S + 3, elapsed
    for srv in (prefill_server, decode_server):
        assert is_idle(srv.wait_idle()), srv.name
    # Nothing sticks: the next request with the right port succeeds.
    body = {"text": "Hello", "sampling_params": GREEDY}
    assert generate(pd_router.url, body)["meta_info"]["finish_reason"]["type"] == "length"


# ---- SMG in PD mode --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smg() -> list[str]:
    return smg_command()


@pytest.fixture(scope="module", params=["http", "grpc"])
def smg_gateway(request, smg, prefill_server, decode_server, model_id) -> PdGateway:
    if request.param == "http":
        urls = prefill_server.url, decode_server.url
    else:
        urls = tuple(f"grpc://127.0.0.1:{grpc_port(s)}" for s in (prefill_server, decode_server))
    gateway = PdGateway(*urls).start(smg)

    def stop():
        gateway.stop()
        assert not gateway.group_alive(), "smg left processes behind"

    request.addfinalizer(stop)
    gateway.wait_ready(model_id)
    return gateway


def test_smg_pd_gives_the_colocated_servers_greedy_outputs(server, smg_gateway, model_id):
    """SMG sends each request to both halves with its own bootstrap fields (over gRPC, as
    GenerateRequest.disaggregated_params); native /generate and chat via the openai SDK."""
    want_native = colocated(server, "native", SMG_PROMPTS)
    want_chat = colocated(server, "chat", SMG_PROMPTS, model_id)

    def through_smg(prompt: str) -> tuple:
        body = {"text": prompt, "sampling_params": GREEDY, "model": model_id}
        answer = generate(smg_gateway.url, body)
        if isinstance(answer, list):  # SMG's gRPC mode answers a single prompt as a list of one
            (answer,) = answer
        return native(answer), ask(client, model_id, prompt, "chat", False)

    with openai_client(smg_gateway.url) as client, ThreadPoolExecutor(8) as pool:
        got = list(pool.map(through_smg, SMG_PROMPTS))
    assert [answer for answer, _ in got] == want_native
    assert [chat for _, chat in got] == want_chat
