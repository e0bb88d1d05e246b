"""SGLang's model gateway (SMG, PyPI `smg`) in front of one Cadence server, through the
official openai client: over gRPC (`grpc://`: SMG parses, templates, tokenizes and
detokenizes in Rust, Cadence serves sglang.grpc.scheduler.SglangScheduler) and over HTTP
(`http://`: SMG proxies the bodies to Cadence's own routes).

One Cadence server (`smg_server`) and one SMG process per mode for the module; every SMG
process is stopped and reaped by its fixture's finalizer. Generations stay short.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest
from e2e_server import free_port, is_idle, wait_until
from grpc_support import grpc_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMG_READY_S = 60
MESSAGES = [{"role": "user", "content": "Say hi"}]


def smg_command() -> list[str]:
    """The `smg` console script of this environment; skips the module's tests when it is not
    installed or cannot run here (its Rust extension does not load on this platform)."""
    script = os.path.join(os.path.dirname(sys.executable), "smg")
    command = [script] if os.path.exists(script) else [shutil.which("smg") or ""]
    if not command[0]:
        pytest.skip("the smg console script is not installed (pip install -e '.[test]')")
    try:
        probe = subprocess.run(
            [*command, "launch", "--help"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"smg cannot start on this platform: {e}")
    if probe.returncode != 0:
        pytest.skip(f"smg cannot start on this platform:\n{(probe.stdout + probe.stderr)[-2000:]}")
    return command


class Gateway:
    """One `smg launch` process in its own session (it renames itself `smg::router`, so it
    is found by its pid and process group, never by name)."""

    def __init__(self, worker_url: str):
        self.worker_url = worker_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmpdir = tempfile.mkdtemp(prefix="cdt-smg-")
        self.log_path = os.path.join(self.tmpdir, "smg.log")
        self.proc: subprocess.Popen | None = None

    def start(self, command: list[str]) -> Gateway:
        args = [
            *command,
            "launch",
            "--worker-urls",
            self.worker_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--policy",
            "round_robin",
            "--log-level",
            "info",
            # Its default waits up to 180 s for requests in flight at SIGTERM; the stop waits
            # 15 s before SIGKILL, which then ended every module that used one.
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

    def model_ids(self) -> list[str]:
        try:
            r = httpx.get(self.url + "/v1/models", timeout=2)
        except httpx.HTTPError:
            return []
        return [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 else []

    def wait_ready(self, model: str) -> None:
        """Until the gateway lists the model and answers a one-token chat: it lists a worker's
        model before its tokenizer (in PD mode, before the pair's other leg) is registered, and
        answers 503 meanwhile."""
        deadline = time.monotonic() + SMG_READY_S
        while model not in self.model_ids() or self._tokenizer_pending(model):
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"smg did not register {model} in {SMG_READY_S}s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def _tokenizer_pending(self, model: str) -> bool:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        try:
            r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=60)
        except httpx.HTTPError:
            return True
        # 503 while starting: a model listed before its tokenizer is registered ("not
        # registered"), or in PD mode a pair with one leg registered ("the pair is incomplete").
        return r.status_code == 503

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 15 s; reaps it (never fails)."""
        if self.proc is not None:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.fixture(scope="module")
def model(smg_server) -> str:
    return httpx.get(smg_server.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def smg() -> list[str]:
    return smg_command()


def _gateway(request, command: list[str], worker_url: str, model: str) -> Gateway:
    gateway = Gateway(worker_url).start(command)

    def stop():
        gateway.stop()
        assert not gateway.group_alive(), "smg left processes behind"

    request.addfinalizer(stop)
    gateway.wait_ready(model)
    return gateway


@pytest.fixture(scope="module")
def grpc_gateway(request, smg, smg_server, model) -> Gateway:
    return _gateway(request, smg, f"grpc://127.0.0.1:{grpc_port(smg_server)}", model)


@pytest.fixture(scope="module")
def http_gateway(request, smg, smg_server, model) -> Gateway:
    return _gateway(request, smg, smg_server.url, model)


@pytest.fixture(params=["grpc", "http"])
def gateway(request) -> Gateway:
    return request.getfixturevalue(f"{request.param}_gateway")


@pytest.fixture(autouse=True)
def leaves_cadence_idle(smg_server):
    yield
    assert is_idle(smg_server.wait_idle()), "a request outlived its test"


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def direct(smg_server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=smg_server.url + "/v1", api_key="unused", max_retries=0, timeout=60
    )


# ---- chat -------------------------------------------------------------------------------------


def test_chat_through_the_gateway_answers_as_cadence_does(gateway, smg_server, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    with client(gateway) as c, direct(smg_server) as d:
        got = c.chat.completions.create(**kwargs)
        want = d.chat.completions.create(**kwargs)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage.prompt_tokens,
        10,
    )


def test_streamed_chat_adds_up_to_the_unary_answer(gateway, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    with client(gateway) as c:
        whole = c.chat.completions.create(**kwargs).choices[0].message.content
        chunks = list(c.chat.completions.create(stream=True, **kwargs))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}


def test_two_samples_with_logprobs_through_grpc(grpc_gateway, model):
    with client(grpc_gateway) as c:
        reply = c.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=4,
            temperature=0.8,
            n=2,
            logprobs=True,
            top_logprobs=2,
        )
    assert sorted(choice.index for choice in reply.choices) == [0, 1]
    for choice in reply.choices:
        entries = choice.logprobs.content
        assert 1 <= len(entries) <= 4 and all(e.logprob <= 0 for e in entries)
        assert all(len(e.top_logprobs) == 2 for e in entries)
        # A sampled character split over byte tokens comes back from the gateway as U+FFFD
        # entries, which it may merge: one entry per token only when none is partial.
        if not any("\ufffd" in e.token for e in entries):
            assert len(entries) == 4, entries
    assert reply.usage.completion_tokens == 8


# ---- native API through the gateway over HTTP ---------------------------------------------------


def test_native_generate_through_the_http_gateway(http_gateway, smg_server, model):
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }
    got = httpx.post(http_gateway.url + "/generate", json={**body, "model": model}, timeout=60)
    want = httpx.post(smg_server.url + "/generate", json=body, timeout=60).json()
    assert got.status_code == 200, got.text
    assert got.json()["text"] == want["text"] and got.json()["output_ids"] == want["output_ids"]


# ---- a client that goes away ------------------------------------------------------------------


def test_a_client_that_disconnects_aborts_its_request_in_cadence(gateway, smg_server, model):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", gateway.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data: {")
            assert smg_server.load()["num_running_reqs"] == 1
        # leaving the block closes the connection mid-stream
    assert wait_until(lambda: is_idle(smg_server.load()), timeout=5), smg_server.load()
