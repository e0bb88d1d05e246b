"""Active health probes: one small task per worker.

Each task probes its worker (and, when the worker answers 200, reads what it says it
serves from GET /capabilities before the answer counts), then sleeps for the interval of the worker's state (short
while `unknown`, the normal interval otherwise) or until it is woken (a new or
recovered worker is probed at once). `dead` workers are not probed until recovered.

Prefill and decode workers (PD mode) also have their GET /server_info read while they are
not yet healthy: a prefill worker's bootstrap port comes from there when it was not
configured, and a worker started in another disaggregation mode than its role never
becomes healthy (its probes fail with a message saying so).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from cadence.router.config import CAPABILITIES, PREFILL, REGULAR, RouterConfig
from cadence.router.workers import HealthState, Worker, WorkerRegistry

logger = logging.getLogger("cadence.router")


class HealthChecker:
    """Runs one probe loop per worker and reports outcomes to the registry."""

    def __init__(
        self, config: RouterConfig, registry: WorkerRegistry, session: aiohttp.ClientSession
    ) -> None:
        self.config = config
        self.registry = registry
        self.session = session
        self._timeout = aiohttp.ClientTimeout(total=config.health_check_timeout_secs)
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._wakers: dict[str, asyncio.Event] = {}

    def watch(self, worker: Worker) -> None:
        """Start probing `worker` now."""
        if worker.id in self._tasks:
            return
        self._wakers[worker.id] = asyncio.Event()
        self._tasks[worker.id] = asyncio.create_task(
            self._run(worker, self._wakers[worker.id]), name=f"probe {worker.url}"
        )

    def wake(self, worker: Worker) -> None:
        """Probe `worker` at once instead of waiting for its next turn."""
        waker = self._wakers.get(worker.id)
        if waker is not None:
            waker.set()

    async def unwatch(self, worker: Worker) -> None:
        """Stop probing `worker` (it was removed)."""
        await self._cancel(worker.id)

    async def stop(self) -> None:
        for worker_id in list(self._tasks):
            await self._cancel(worker_id)

    async def _cancel(self, worker_id: str) -> None:
        self._wakers.pop(worker_id, None)
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, worker: Worker, waker: asyncio.Event) -> None:
        while True:
            waker.clear()
            if worker.health is not HealthState.DEAD:
                await self.probe(worker)
            if worker.health is HealthState.UNKNOWN:
                delay = min(
                    self.config.health_check_startup_interval_secs,
                    self.config.health_check_interval_secs,
                )
            else:
                delay = self.config.health_check_interval_secs
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waker.wait(), timeout=delay)

    async def probe(self, worker: Worker) -> bool:
        """Probe once; the registry applies the thresholds. True when it answered 200."""
        url = worker.url + self.config.health_check_endpoint
        status: int | None = None
        error: str | None = None
        try:
            async with self.session.get(url, timeout=self._timeout, headers=self._headers) as resp:
                status = resp.status
                await resp.read()
        except TimeoutError:
            error = f"probe timed out after {self.config.health_check_timeout_secs}s"
        except (aiohttp.ClientError, OSError) as exc:
            error = f"probe failed: {exc!r}"
        problem = None
        if status != 200:
            logger.debug("probe %s: %s", url, error or status)
        else:
            self.registry.record_capabilities(worker, await self.read_capabilities(worker))
            if worker.role != REGULAR and worker.health is not HealthState.HEALTHY:
                problem = await self.read_pd_server_info(worker)
                if problem is not None:
                    logger.warning("worker %s: %s", worker.url, problem)
        self.registry.record_probe(worker, status, error, problem)
        return status == 200 and problem is None

    async def read_pd_server_info(self, worker: Worker) -> str | None:
        """Read a PD worker's GET /server_info: the bootstrap port of a prefill worker and
        the disaggregation mode it runs in. Returns what keeps it from serving, or None."""
        info = await self._get_json(worker, "/server_info")
        info = info if isinstance(info, dict) else {}
        mode = info.get("disaggregation_mode")
        if isinstance(mode, str) and mode != worker.role:
            return (
                f"it runs with --disaggregation-mode {mode} but the router lists it as a "
                f"{worker.role} worker; start it with --disaggregation-mode {worker.role} or "
                "list it as the role it has"
            )
        if worker.role != PREFILL:
            return None
        port = info.get("disaggregation_bootstrap_port")
        if isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535:
            worker.reported_bootstrap_port = port
        if worker.bootstrap_port is None:
            return (
                "no bootstrap port: its GET /server_info has no disaggregation_bootstrap_port; "
                f"give it as --prefill {worker.url} PORT"
            )
        return None

    async def _get_json(self, worker: Worker, path: str) -> object:
        """The worker's JSON answer to GET `path`, or None when it has none (any failure)."""
        try:
            async with self.session.get(
                worker.url + path, timeout=self._timeout, headers=self._headers
            ) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None

    async def read_capabilities(self, worker: Worker) -> frozenset[str] | None:
        """The worker's GET /capabilities list (names the router does not know are left out);
        None when it has no such route or answers something else, as older workers do."""
        body = await self._get_json(worker, "/capabilities")
        names = body.get("capabilities") if isinstance(body, dict) else None
        if not isinstance(names, list):
            return None
        return frozenset(n for n in names if isinstance(n, str) and n in CAPABILITIES)
