"""`cadence router --service-discovery` as a real process against a stand-in API server.

The router process lists and watches the pods of kube_fakes.FakeKubeApi (in this test's
event loop, on a loopback socket) and routes to a fake worker at the pod's address.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import aiohttp
import pytest
from kube_fakes import FakeKubeApi
from router_fakes import closed_port_url

# Starts a router the way `cadence router` does, with or without discovery, and says
# whether the Kubernetes client got loaded.
IMPORT_SCRIPT = """
import asyncio, sys
from cadence.router.cli import parse_config
from cadence.router.server import Router

async def main():
    router = Router(parse_config(sys.argv[1:]), [])
    await router.start()
    await router.stop()

asyncio.run(main())
print("KUBERNETES:" + str(any(m.split(".")[0] == "kubernetes" for m in sys.modules)))
"""


@pytest.fixture
async def kube_api():
    api = await FakeKubeApi().start()
    yield api
    await api.stop()


def _port() -> int:
    return int(closed_port_url().rsplit(":", 1)[1])


async def _workers(session: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    async with session.get(url + "/workers") as resp:
        assert resp.status == 200
        return {w["url"]: w for w in (await resp.json())["workers"]}


async def test_router_process_routes_to_the_pods_it_discovers(kube_api, make_worker, spawn):
    worker = await make_worker(host="127.0.0.2", body=b'{"from": "the pod"}')
    await kube_api.put_pod("cadence-0", "127.0.0.2", namespace="serving")
    await kube_api.put_pod("elsewhere", "127.0.0.3", namespace="other")
    port = _port()
    proc = spawn(
        "--port", str(port), "--enable-admin-api",
        "--service-discovery", "--selector", "app=cadence",
        "--service-discovery-namespace", "serving",
        "--service-discovery-port", str(worker.port),
        "--service-discovery-api-server", kube_api.url,
        "--health-check-startup-interval-secs", "0.05", "--health-success-threshold", "1",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                async with session.get(url + "/ready") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "router never became ready"
            await asyncio.sleep(0.05)
        assert set(await _workers(session, url)) == {worker.url}

        async with session.post(url + "/v1/completions", json={"prompt": "hi"}) as resp:
            assert resp.status == 200
            assert resp.headers["x-cadence-worker"] == worker.url
            assert await resp.read() == b'{"from": "the pod"}'

        await kube_api.delete_pod("cadence-0", namespace="serving")
        deadline = time.monotonic() + 10
        while await _workers(session, url):
            assert time.monotonic() < deadline, "the deleted pod stayed a worker"
            await asyncio.sleep(0.05)
        async with session.get(url + "/ready") as resp:
            assert resp.status == 503

    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "pod serving/cadence-0 is ready: added regular worker" in stderr
    assert "pod serving/cadence-0 was deleted: removed worker" in stderr
    assert {path for path, _ in kube_api.requests} == {"/api/v1/namespaces/serving/pods"}


async def _run_script(*args: str) -> tuple[int, str, str]:
    """IMPORT_SCRIPT in a child process, this loop left free to serve the API stand-in."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", IMPORT_SCRIPT, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, stdout.decode(), stderr.decode()


async def test_a_router_without_discovery_never_loads_the_kubernetes_client(kube_api):
    code, out, err = await _run_script("--port", "0")
    assert code == 0, err
    assert "KUBERNETES:False" in out
    code, out, err = await _run_script(
        "--port", "0", "--service-discovery", "--selector", "app=cadence",
        "--service-discovery-api-server", kube_api.url,
    )  # fmt: skip
    assert code == 0, err
    assert "KUBERNETES:True" in out  # so the check above can see it


async def test_discovery_without_any_kubernetes_configuration_is_a_clear_error(
    spawn, tmp_path, monkeypatch
):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    proc = spawn("--port", "0", "--service-discovery", "--selector", "app=cadence")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    assert "no Kubernetes API to watch" in stderr
    assert "--service-discovery-api-server" in stderr
