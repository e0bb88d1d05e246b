"""Fixtures: fake upstream workers, routers in front of them, and a client session.

Everything runs in-process on the test's event loop, over real loopback sockets; `spawn`
starts router processes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from pd_fakes import make_pd_router, make_server  # noqa: F401 (PD mode fixtures)
from router_fakes import FakeWorker, wait_for

from cadence.router.config import RouterConfig, load_worker_specs
from cadence.router.server import Router

# Short probe timing so health transitions take milliseconds, not seconds.
FAST_PROBES = {
    "health_check_interval_secs": 0.05,
    "health_check_startup_interval_secs": 0.02,
    "health_check_timeout_secs": 1.0,
    "retry_initial_backoff_ms": 1.0,
    "retry_max_backoff_ms": 5.0,
}


@pytest.fixture
async def make_worker() -> Callable[..., Awaitable[FakeWorker]]:
    workers: list[FakeWorker] = []

    async def make(**knobs) -> FakeWorker:
        worker = await FakeWorker(**knobs).start()
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        await worker.stop()


@pytest.fixture
async def make_router() -> Callable[..., Awaitable[Router]]:
    routers: list[Router] = []

    async def make(urls: list[str], wait_healthy: bool = True, **overrides) -> Router:
        config = RouterConfig(port=0, worker_urls=tuple(urls), **{**FAST_PROBES, **overrides})
        router = Router(config, load_worker_specs(config))
        await router.start()
        routers.append(router)
        if wait_healthy:
            await wait_for(
                lambda: len(router.registry.routable) == len(urls), what="workers healthy"
            )
        return router

    yield make
    for router in routers:
        await router.stop()


@pytest.fixture
async def client() -> aiohttp.ClientSession:
    session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=10))
    yield session
    await session.close()


@pytest.fixture
def spawn():
    """Starts `python -m cadence.router ARGS` processes (output piped); kills what is left."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cadence.router", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
