"""`python -m cadence.launch_server --dp-size 2` (SGLang's launch line, which `cadence serve`
hands to `cadence launch`): two replicas of the default model and the router in front,
started by one command as a real process.

Through the router's port, with the openai client: chat answers, from both replicas in turn
(round_robin). SIGKILL of one replica: the launcher logs which one died and how, keeps
running, the router's probes take the replica out of rotation and the survivor answers.
SIGTERM of the launcher: exit code 0 within seconds and not one process it started left.

One launcher for the module (each test goes on from where the previous one left it: they
run in file order). Every process it starts carries a tag in its environment, so a scan of
/proc finds them wherever they were reparented to; a finalizer kills what is left.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import pytest
from e2e_server import _DIE_WITH_PARENT, SESSION_TAG, free_port, tagged_pids, wait_until

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

START_DEADLINE_S = 300  # two replicas load at once on a small shared machine
PROBE_S = 0.3  # the router's health probe interval here


class Launcher:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag = f"{SESSION_TAG}-launch-{uuid.uuid4().hex[:8]}"
        self.tmpdir = tempfile.mkdtemp(prefix="cdt-launch-", dir="/tmp")  # short: socket paths
        self.log_path = os.path.join(self.tmpdir, "launch.log")
        cmd = [
            *(sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid())),
            *(sys.executable, "-m", "cadence.launch_server", "--dp-size", "2"),
            *("--port", str(self.port), "--dtype", "float32", "--max-total-tokens", "2048"),
            *("--skip-warmup", "--lazy-kv-pool"),
            *("--router-policy", "round_robin", "--router-enable-admin-api"),
            *("--router-health-check-interval-secs", str(PROBE_S)),
            *("--router-health-check-startup-interval-secs", "0.1"),
            *("--router-health-failure-threshold", "1", "--router-health-success-threshold", "1"),
        ]
        env = dict(os.environ, TMPDIR=self.tmpdir, CADENCE_E2E_TAG=self.tag, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)  # fmt: skip

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while "ready: send requests to" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"launcher not ready (exit {self.proc.poll()}):\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def replicas(self) -> dict[int, tuple[str, int]]:
        """Each replica's URL and pid, as the launcher announced them."""
        found = re.findall(r"replica (\d+) starting: (http://\S+), pid (\d+)", self.log())
        return {int(i): (url, int(pid)) for i, url, pid in found}

    def workers(self) -> dict[str, dict]:
        body = httpx.get(self.url + "/workers", timeout=5).raise_for_status().json()
        return {w["url"]: w for w in body["workers"]}

    def destroy(self) -> None:
        for pid in tagged_pids(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@pytest.fixture(scope="module")
def launcher():
    launched = Launcher()
    try:
        launched.wait_ready()
        yield launched
    finally:
        launched.destroy()


def chat(client, text: str) -> tuple[str, str]:
    """The answer's text and the replica that gave it (the router's x-cadence-worker)."""
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "user", "content": text}], max_tokens=4
    )
    answer = raw.parse()
    return answer.choices[0].message.content, raw.headers["x-cadence-worker"]


def test_both_replicas_answer_through_the_router(launcher):
    replicas = launcher.replicas()
    urls = {url for url, _ in replicas.values()}
    assert len(urls) == 2, launcher.log()[-3000:]
    assert set(launcher.workers()) == urls
    assert all(w["health"] == "healthy" for w in launcher.workers().values())
    client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
    seen = []
    for i in range(4):
        text, worker = chat(client, f"Say a number: {i}")
        assert text
        seen.append(worker)
    assert set(seen) == urls  # round_robin: both replicas serve
    assert all(w["num_requests"] >= 2 for w in launcher.workers().values())


def test_a_killed_replica_leaves_rotation_and_the_launcher_says_so(launcher):
    (survivor, _), (victim, victim_pid) = launcher.replicas()[0], launcher.replicas()[1]
    os.kill(victim_pid, signal.SIGKILL)
    assert wait_until(lambda: launcher.workers()[victim]["health"] != "healthy", 10 * PROBE_S + 5)
    assert launcher.workers()[survivor]["health"] == "healthy"
    client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
    for i in range(3):
        text, worker = chat(client, f"Name a colour: {i}")
        assert text and worker == survivor
    assert wait_until(lambda: "replica 1 process died (was killed by SIGKILL)" in launcher.log(), 5)
    assert "not restarted" in launcher.log()
    assert launcher.proc.poll() is None  # it keeps serving on the survivor
    assert launcher.log().count("replica 1 starting") == 1  # started once, never again


def test_sigterm_stops_the_router_and_the_replicas_with_exit_0(launcher):
    started = tagged_pids(launcher.tag)
    assert launcher.proc.pid in started and len(started) >= 5  # launcher, router, a replica x3
    t0 = time.monotonic()
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(20) == 0, launcher.log()[-3000:]
    assert time.monotonic() - t0 < 15
    assert "cadence launch stopped" in launcher.log()
    assert wait_until(lambda: not tagged_pids(launcher.tag), 10), tagged_pids(launcher.tag)
    with pytest.raises(httpx.ConnectError):
        httpx.get(launcher.url + "/health", timeout=2)
