"""Plugins as users install them, seen through `cadence serve`.

The two example packages (examples/plugins/) are pip-installed into a temporary directory
(`--target`, nothing touches the venv); a few more distributions are written by hand as
dist-info directories: a platform whose hardware is absent, a second active platform, and
a general plugin that fails to load. Each `cadence serve` gets only the directories its
case needs on PYTHONPATH, so what is "installed" differs per case.

One real server shows the general plugin's hooks running in the front, scheduler and
detokenizer processes (the plugin writes JSON lines with its pid to a file), and that
CADENCE_PLATFORM picks the example platform among two active ones. The failure cases end
before any model is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "plugins"
SERVER_START_DEADLINE_SECS = 300

TEST_PLATFORMS = """
from cadence.platforms.cpu import CpuPlatform


class OtherPlatform(CpuPlatform):
    name = "other"


def activate_absent():
    return None  # its hardware is not in this machine


def activate_other():
    return "cadence_test_platforms:OtherPlatform"


def register_broken():
    raise ImportError("libvendor.so: cannot open shared object file")
"""


def _dist(root: Path, name: str, entry_points: str) -> Path:
    """A distribution made of a dist-info directory only (its code lives in `root`)."""
    info = root / f"{name}-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    return root


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("plugins")
    examples = tmp / "src"
    shutil.copytree(EXAMPLES, examples)  # builds write into the source tree; keep the repo clean
    installed = tmp / "installed"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(installed),
            str(examples / "request-counter"),
            str(examples / "cpu-alt"),
        ],
        check=True,
        timeout=300,
    )
    code = tmp / "code"
    code.mkdir()
    (code / "cadence_test_platforms.py").write_text(TEST_PLATFORMS)
    return {
        "examples": installed,
        "code": code,
        "absent": _dist(
            tmp / "absent",
            "cadence_test_absent",
            "[cadence.platforms]\nabsent = cadence_test_platforms:activate_absent\n",
        ),
        "other": _dist(
            tmp / "other",
            "cadence_test_other",
            "[cadence.platforms]\nother = cadence_test_platforms:activate_other\n",
        ),
        "broken": _dist(
            tmp / "broken",
            "cadence_test_broken",
            "[cadence.plugins]\nbroken = cadence_test_platforms:register_broken\n",
        ),
    }


def _env(sites: dict[str, Path], *names: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CADENCE_PLATFORM", "CADENCE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(str(sites[n]) for n in ("examples", "code", *names))
    env.update(extra)
    return env


def _serve(env: dict[str, str], *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", *args],
        env=env,
        cwd=REPO,
        start_new_session=True,
        **popen,
    )


def _fails(env: dict[str, str], command: str = "serve") -> str:
    """Runs a command expected to stop during start-up; returns its stderr."""
    # A random high port plus 10000 is no port: serve must not rely on the default gRPC port.
    extra = ["--disable-grpc"] if command == "serve" else []
    proc = subprocess.run(
        [sys.executable, "-m", "cadence.cli", command, "--port", str(_free_port()), *extra],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0, proc.stderr
    return proc.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _request(url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else {}  # /health answers with no body
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_DEADLINE_SECS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"cadence serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if _request(f"{base}/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"cadence serve did not become healthy:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_hooks_run_in_every_server_process_and_cadence_platform_picks_the_example(sites, tmp_path):
    events_file = tmp_path / "events.jsonl"
    log = tmp_path / "serve.log"
    port = _free_port()
    # Two out-of-tree platforms are active here (cpu-alt and other): CADENCE_PLATFORM decides.
    env = _env(
        sites, "other", CADENCE_PLATFORM="cpu-alt", CADENCE_REQUEST_COUNTER_FILE=str(events_file)
    )
    base = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = _serve(
            env,
            "--port",
            str(port),
            "--disable-grpc",
            "--max-total-tokens",
            "2048",
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_healthy(proc, base, log)
        rids = []
        for prompt in ("The capital of France is", "One, two,"):
            status, body = _request(
                f"{base}/generate",
                {"text": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
            )
            assert status == 200
            rids.append(body["meta_info"]["id"])
        status, info = _request(f"{base}/get_server_info")
        assert status == 200
        assert info["platform"] == "cpu-alt"
        assert info["page_size"] == 32  # CpuAltPlatform.apply_server_args_defaults ran in the front
    finally:
        _stop(proc)
    assert proc.returncode == 0, log.read_text()[-4000:]

    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    front = proc.pid
    loaded = {e["pid"] for e in events if e["event"] == "loaded"}
    assert (
        front in loaded and len(loaded) == 3
    )  # front, scheduler, detokenizer: each loaded it once
    assert len([e for e in events if e["event"] == "loaded"]) == 3

    [finalized] = [e for e in events if e["event"] == "server_args_finalized"]
    assert (
        finalized["pid"] == front and finalized["page_size"] == 32
    )  # after the platform's defaults

    finished = [e for e in events if e["event"] == "request_finished"]
    assert {e["pid"] for e in finished} == {front}
    assert [e["count"] for e in finished] == list(range(1, len(finished) + 1))
    ours = [e for e in finished if e["rid"] in rids]
    assert [e["rid"] for e in ours] == rids and all(e["finish_reason"] == "length" for e in ours)

    batches = [e for e in events if e["event"] == "batch_scheduled"]
    scheduler_pids = {e["pid"] for e in batches}
    assert len(scheduler_pids) == 1 and scheduler_pids < loaded - {front}
    for rid in rids:
        mine = [e for e in batches if rid in e["rids"]]
        assert [e["is_prefill"] for e in mine] == [
            True,
            False,
            False,
        ]  # prefill (+ token 1), 2 decodes


def test_unknown_platform_name_fails_naming_it(sites):
    err = _fails(_env(sites, CADENCE_PLATFORM="nope"))
    assert "CADENCE_PLATFORM='nope'" in err and "cpu-alt" in err  # lists what is installed


def test_platform_whose_hardware_is_absent_fails_naming_it(sites):
    err = _fails(_env(sites, "absent", CADENCE_PLATFORM="absent"))
    assert "platform 'absent'" in err and "returned None" in err


def test_two_active_platforms_without_cadence_platform_fail(sites):
    err = _fails(_env(sites, "other"))
    assert (
        "several platform plugins are active (cpu-alt, other)" in err and "CADENCE_PLATFORM" in err
    )


def test_a_plugin_that_fails_to_load_stops_serve_and_the_router(sites):
    env = _env(sites, "broken")
    for command in ("serve", "router"):
        err = _fails(env, command)
        assert "plugin 'broken'" in err and "libvendor.so" in err


def test_the_whitelist_leaves_a_broken_plugin_out(sites):
    # Start-up gets past plugin loading and stops later, at the (unknown) platform.
    err = _fails(_env(sites, "broken", CADENCE_PLUGINS="request_counter", CADENCE_PLATFORM="nope"))
    assert "CADENCE_PLATFORM='nope'" in err and "broken" not in err
