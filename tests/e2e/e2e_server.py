"""Launched `cadence serve` processes for the end-to-end tests, and what they leave behind.

Each server runs `python -m cadence.launch_server` on free ports, in its own session, with
its own TMPDIR (so its ZMQ socket directory is known exactly and other servers on the
machine never get in the way) and a tag in its environment that every child inherits: a
scan of /proc for the tag finds every process the server started, wherever it was
reparented to. No psutil.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx

SESSION_TAG = uuid.uuid4().hex  # in the environment of every server of this test session
LOAD_DEADLINE_S = 300  # many servers load at once on a small shared machine
API_KEY = "sk-e2e-secret-7b1d"  # the --api-key of api_key_server; must never be echoed


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free right now and not given to another server of this session."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _server_arg_names() -> set[str]:
    from cadence.server_args import ServerArgs

    return set(ServerArgs.field_names())


def tagged_pids(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries `tag`."""
    needle = tag.encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        pids.append(int(entry))
    return pids


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/task/*/children."""
    kids: list[int] = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(task) as f:
                kids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return kids


# Runs first in a launched server's process, then execs the server: SIGTERM comes to it when
# the test run dies (PR_SET_PDEATHSIG outlives exec), so nothing outlives pytest. Not a
# `preexec_fn`: that makes subprocess fork() the whole pytest process, whose gRPC channels'
# fork handlers then run and can deadlock it with the GIL held, where no test timeout fires.
# Without one, subprocess starts the child with vfork and no fork handlers run.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('the test run ended before the server started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def tried(attempt, ok, tries: int = 3):
    """attempt() until ok(its result), at most `tries` times; the last result. For checks that
    a busy machine can defeat by timing alone (a front held while every token of a short
    stream is made sends them as one chunk): a server without the property fails every try."""
    result = attempt()
    for _ in range(tries - 1):
        if ok(result):
            break
        result = attempt()
    return result


class Server:
    """One launched server. `start()` returns at once; `wait_ready()` waits for /health 200."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None):
        self.name = name
        self.args = args
        self.extra_env = env or {}
        self.port = 0
        self.url = ""
        self.tag = f"{SESSION_TAG}-{name}-{uuid.uuid4().hex[:8]}"
        self.tmpdir = tempfile.mkdtemp(
            prefix=f"cdt-{name[:10]}-", dir="/tmp"
        )  # short: socket paths
        self.log_path = os.path.join(self.tmpdir, "server.log")
        self.profile_dir = os.path.join(self.tmpdir, "profiles")  # the server's --profile-dir
        self.proc: subprocess.Popen | None = None
        self.health_history: list[tuple[float, int | str]] = []  # (seconds since start, status)
        self.early_responses: dict[
            str, tuple[int, str]
        ] = {}  # route -> (status, body) seen while loading
        self.ready = threading.Event()
        self.started_at = 0.0

    # ---- life ------------------------------------------------------------------------

    def start(self) -> Server:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_history, self.early_responses = [], {}
        cmd = [
            *(sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid())),
            sys.executable,
            "-m",
            "cadence.launch_server",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            *self.args,
        ]
        if "grpc_port" in _server_arg_names() and "--disable-grpc" not in self.args:
            cmd += ["--grpc-port", str(free_port())]
        if "profile_dir" in _server_arg_names() and "--profile-dir" not in self.args:
            cmd += ["--profile-dir", self.profile_dir]
        env = dict(
            os.environ,
            **self.extra_env,
            TMPDIR=self.tmpdir,
            CADENCE_E2E_TAG=self.tag,
            PYTHONUNBUFFERED="1",
        )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        self.started_at = time.monotonic()
        threading.Thread(
            target=self._watch_health,
            args=(self.proc, self.url),
            name=f"health-{self.name}",
            daemon=True,
        ).start()
        return self

    def _watch_health(self, proc: subprocess.Popen, url: str) -> None:
        """Polls /health from launch until 200, recording every answer (the 503 phase included)."""
        with httpx.Client(timeout=5) as client:
            while proc.poll() is None and time.monotonic() - self.started_at < LOAD_DEADLINE_S:
                try:
                    status: int | str = client.get(url + "/health").status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.health_history.append((time.monotonic() - self.started_at, status))
                if status == 503 and "/generate" not in self.early_responses:
                    for method, route, body in (
                        ("GET", "/health", None),
                        ("POST", "/generate", {"text": "hi"}),
                    ):
                        try:
                            r = client.request(method, url + route, json=body)
                            self.early_responses[route] = (r.status_code, r.text)
                        except httpx.HTTPError:
                            pass
                if status == 200:
                    self.ready.set()
                    return
                time.sleep(0.1)

    def wait_ready(self, timeout: float = LOAD_DEADLINE_S) -> Server:
        deadline = time.monotonic() + timeout
        relaunches = 2
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None:
                if relaunches and "already in use" in self.log_text():
                    relaunches -= 1  # someone took one of its ports between picking and binding
                    self.start()
                    continue
                raise RuntimeError(
                    f"server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server {self.name} not ready within {timeout:.0f}s:\n{self.log_tail()}"
                )
        # With --api-workers N each front answers /health for itself, so the first 200 says
        # one is ready: a test's connection may still land on one loading (503). Every front
        # logs when it is ready.
        fronts = self.num_fronts()
        ready = lambda: self.log_text().count("Cadence is ready") >= fronts  # noqa: E731
        if fronts > 1 and not wait_until(ready, max(deadline - time.monotonic(), 1)):
            raise RuntimeError(f"server {self.name}: not all {fronts} fronts became ready")
        return self

    def num_fronts(self) -> int:
        """Front processes of this server (--api-workers; 1 by default)."""
        if "--api-workers" not in self.args:
            return 1
        return int(self.args[self.args.index("--api-workers") + 1])

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int | None:
        if self.proc.poll() is None:
            self.send_signal(sig)
        return self.wait_exit(timeout)

    def destroy(self) -> None:
        """Kills whatever is left of this server (finalizer; never fails)."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop(timeout=15)
        for pid in self.leftover_pids() + (
            [self.proc.pid] if self.proc and self.proc.poll() is None else []
        ):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    # ---- what it is made of ------------------------------------------------------------

    def children(self) -> list[int]:
        return child_pids(self.proc.pid)

    def leftover_pids(self) -> list[int]:
        """Every live process this server started (the front included while it runs)."""
        return tagged_pids(self.tag)

    def socket_dirs(self) -> list[str]:
        return glob.glob(os.path.join(self.tmpdir, "cadence-ipc-*"))

    def child_pid(self, role: str) -> int:
        """Pid of the child that bound the `role` socket ('scheduler' or 'detokenizer')."""
        (directory,) = self.socket_dirs()
        path = os.path.join(directory, role)
        inodes = set()
        with open("/proc/net/unix") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if len(parts) >= 8 and parts[7] == path:
                    inodes.add(parts[6])
        for pid in self.children():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return pid
        raise LookupError(f"no child of {self.name} holds the {role} socket {path}")

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, n: int = 4000) -> str:
        lines = [
            line for line in self.log_text().splitlines() if "tensor/s]" not in line
        ]  # no load progress bars
        return "\n".join(lines)[-n:]

    # ---- talking to it -----------------------------------------------------------------

    def client(self, timeout: float = 120, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, **kwargs)

    def load(self, **kwargs) -> dict:
        with self.client(**kwargs) as c:
            r = c.get("/v1/loads")
            r.raise_for_status()
            return r.json()["loads"][0]

    def wait_idle(self, timeout: float = 10.0, **kwargs) -> dict:
        """Polls /v1/loads until no request runs, waits or holds KV tokens; returns the last load."""
        last: dict = {}

        def idle() -> bool:
            nonlocal last
            last = self.load(**kwargs)
            return (
                last["num_running_reqs"] == 0
                and last["num_waiting_reqs"] == 0
                and last["num_used_tokens"] == 0
            )

        wait_until(idle, timeout, interval=0.05)
        return last


PLUGINS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")
# The zero-cost model runner (a benchmark plugin): tokens without computing anything.
BENCH_PLUGINS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "plugins"
)


def zero_cost_env() -> dict[str, str]:
    """The environment of a server whose model runner is the zero-cost plugin's."""
    if BENCH_PLUGINS_DIR not in sys.path:
        sys.path.append(BENCH_PLUGINS_DIR)
    from cadence_zero_cost import plugin_env

    return plugin_env()


def fault_plugin_env() -> dict[str, str]:
    """The environment of a server with the fault-injection test plugin installed: its
    module on PYTHONPATH and a dist-info directory declaring its entry point."""
    root = tempfile.mkdtemp(prefix="cdt-fault-plugin-")
    info = os.path.join(root, "cadence_fault_injection-0.0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: cadence-fault-injection\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(
            "[cadence.plugins]\nfault_injection = cadence_fault_injection:register\n\n"
            "[cadence.logit_processors]\nban_tokens = cadence_test_processors:ban_tokens\n"
            "explode = cadence_test_processors:explode\n"
        )
    path = os.pathsep.join(p for p in (root, PLUGINS_DIR, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "CADENCE_PLUGINS": "fault_injection"}


PIPELINE_YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipelines", "steps.yaml")


def pipeline_env() -> dict[str, str]:
    """The environment of a --pipeline server: the test executors importable by its stages."""
    helpers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit", "pipeline")
    path = os.pathsep.join(p for p in (helpers, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def is_idle(load: dict) -> bool:
    return (
        load["num_running_reqs"] == 0
        and load["num_waiting_reqs"] == 0
        and load["num_used_tokens"] == 0
    )


def sse_events(lines) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
