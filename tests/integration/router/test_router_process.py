"""`python -m cadence.router` as a real process: serves, stays free of torch, exits cleanly."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from router_fakes import wait_for

NO_TORCH_SCRIPT = """
import asyncio, sys
import cadence.router.cli
from cadence.router.config import RouterConfig
from cadence.router.server import Router

async def main():
    router = Router(RouterConfig(port=0), [])
    await router.start()
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/live") as r:
            assert r.status == 200
    await router.stop()

asyncio.run(main())
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("HEAVY:" + ",".join(heavy))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_router_modules_and_a_running_router_do_not_import_torch():
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "HEAVY:\n" in out.stdout, out.stdout  # none of them loaded


async def test_cli_router_serves_without_torch_and_exits_on_sigterm(make_worker, spawn):
    worker = await make_worker(body=b"from worker")
    port = _free_port()
    proc = spawn("--port", str(port), "--worker-urls", worker.url,
                 "--health-check-startup-interval-secs", "0.05", "--log-level", "warning")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                async with session.get(url + "/ready") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                pass
            assert time.monotonic() < deadline, "router did not become ready"
            await asyncio.sleep(0.05)
        async with session.post(url + "/v1/chat/completions", data=b"{}") as resp:
            assert await resp.read() == b"from worker"
    maps = Path(f"/proc/{proc.pid}/maps")
    if maps.exists():
        assert "libtorch" not in maps.read_text(), "the running router mapped torch's libraries"
    proc.send_signal(signal.SIGTERM)
    await wait_for(lambda: proc.poll() is not None, timeout=10, what="exit after SIGTERM")
    assert proc.returncode == 0


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--worker-urls", "ftp://example.com"], "worker_urls"),
        (["--worker-urls", "http://169.254.169.254/latest"], "worker_urls"),
        (["--worker-urls", "http://a:1", "http://A:1/"], "duplicate"),
        (["--policy", "fastest"], "policy"),
        (["--health-failure-threshold", "0"], "health_failure_threshold"),
        (["--worker-config", "/nonexistent/workers.yaml"], "worker_config"),
        (["--api-key", "k", "--admin-api-key", "k"], "admin_api_key"),
        (["--admin-api-key", "\u20ac"], "admin_api_key"),
    ],
)
def test_cli_rejects_bad_config_with_the_field_named(spawn, args, field):
    proc = spawn(*args)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert field in err


def test_cadence_router_help_lists_every_flag():
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from cadence.cli import main; sys.exit(main(['router', '--help']))"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--worker-urls", "--worker-config", "--policy", "--max-payload-size", "--route-log",
                 "--api-key", "--admin-api-key", "--enable-admin-api", "--health-check-endpoint",
                 "--retry-max-retries"):  # fmt: skip
        assert flag in out.stdout


def test_cli_port_in_use_exits_1_and_cleans_up(spawn):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = spawn("--port", str(busy.getsockname()[1]))
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "cannot listen" in err
    assert "Unclosed" not in err  # the client session was closed on the way out
