"""An in-process `cadence router` in front of launched servers, with fast health probes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from cadence.router.config import RouterConfig, load_worker_specs
from cadence.router.server import Router

FAST_PROBES = {
    "health_check_interval_secs": 0.3,
    "health_check_startup_interval_secs": 0.1,
    "health_check_timeout_secs": 2.0,
    "health_failure_threshold": 1,
    "health_success_threshold": 1,
}


async def start_router(urls: list[str]) -> Router:
    config = RouterConfig(port=0, worker_urls=tuple(urls), **FAST_PROBES)
    router = Router(config, load_worker_specs(config))
    await router.start()
    await wait_for(lambda: len(router.registry.routable) == len(urls), "workers healthy", 60)
    return router


async def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)
