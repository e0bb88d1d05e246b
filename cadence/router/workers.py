"""Worker state and the registry that owns every health transition.

Everything here runs on the router's one event loop thread, so there are no locks: a
mutation is never interleaved with another one.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from cadence.router.config import (
    PREFILL,
    REGULAR,
    WorkerSpec,
    normalize_worker_url,
    short_repr,
    worker_id,
    worker_spec_from_dict,
)

logger = logging.getLogger("cadence.router")

# Answers that say the worker is in trouble rather than the request being wrong.
FAILURE_STATUSES = frozenset({408, 429})


class HealthState(str, enum.Enum):  # noqa: UP042 (str() and JSON keep the value as before)
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DEAD = "dead"


def is_failure_status(status: int) -> bool:
    """408, 429 and 5xx count against a worker; every other answer (4xx included) does not."""
    return status >= 500 or status in FAILURE_STATUSES


@dataclass(eq=False, slots=True)
class Worker:
    """One upstream replica and everything the router knows about it."""

    url: str
    id: str
    model: str | None
    capabilities: frozenset[str] | None  # what routing uses; None: can do everything
    # Declared in the router's config or admin API (wins), and as the worker reports them
    # (GET /capabilities, read at registration and on every successful probe).
    declared_capabilities: frozenset[str] | None = None
    reported_capabilities: frozenset[str] | None = None
    health: HealthState = HealthState.UNKNOWN
    disabled: bool = False
    active: int = 0  # requests routed to it and not yet finished
    num_requests: int = 0  # attempts routed to it since it was added
    num_failures: int = 0  # failed probes and failed requests since it was added
    consecutive_successes: int = 0
    consecutive_failures: int = 0
    last_status: int | None = None
    last_error: str | None = None
    last_check_time: float | None = None  # wall-clock time of the last probe
    role: str = REGULAR  # regular, or prefill / decode in PD mode
    # Prefill workers: the KV bootstrap server's port as configured (wins) and as the
    # worker's /server_info reports it (read while the worker is not yet healthy).
    configured_bootstrap_port: int | None = None
    reported_bootstrap_port: int | None = None

    @property
    def bootstrap_port(self) -> int | None:
        """The port a decode worker reaches this prefill worker's bootstrap server on."""
        if self.configured_bootstrap_port is not None:
            return self.configured_bootstrap_port
        return self.reported_bootstrap_port

    @property
    def is_routable(self) -> bool:
        return self.health is HealthState.HEALTHY and not self.disabled

    def can_serve(self, model: str | None, capabilities: frozenset[str]) -> bool:
        if model is not None and self.model is not None and model != self.model:
            return False
        return self.capabilities is None or capabilities <= self.capabilities

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "model": self.model,
            "capabilities": None if self.capabilities is None else sorted(self.capabilities),
            "capabilities_source": (
                "config"
                if self.declared_capabilities is not None
                else "worker"
                if self.reported_capabilities is not None
                else None
            ),
            "health": self.health.value,
            "disabled": self.disabled,
            "routable": self.is_routable,
            "active": self.active,
            "num_requests": self.num_requests,
            "num_failures": self.num_failures,
            "consecutive_successes": self.consecutive_successes,
            "consecutive_failures": self.consecutive_failures,
            "last_status": self.last_status,
            "last_error": self.last_error,
            "last_check_time": self.last_check_time,
            "role": self.role,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_port_source": (
                "config"
                if self.configured_bootstrap_port is not None
                else "worker"
                if self.reported_bootstrap_port is not None
                else None
            ),
        }


class WorkerRegistry:
    """The set of workers, their health state machine, and the cached routable list.

    unknown --success x S--> healthy --failure x F--> unhealthy --success x S--> healthy
    any state --mark dead--> dead (probes skip it) --recover--> unknown (probed at once)
    where S and F are the success and failure thresholds. Failed probes and failed
    requests both count towards F; only probes count towards S; a successful request
    (any answer but 408, 429 or a 5xx the worker does not blame on the request) resets
    the failure streak. `disabled` is independent of the state.
    """

    def __init__(self, success_threshold: int, failure_threshold: int) -> None:
        self.success_threshold = success_threshold
        self.failure_threshold = failure_threshold
        self._workers: dict[str, Worker] = {}
        self._routable: tuple[Worker, ...] = ()

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def routable(self) -> tuple[Worker, ...]:
        """Routable workers in the order they were added (cached; hot path)."""
        return self._routable

    def get(self, key: str) -> Worker | None:
        """Find a worker by id, or by its URL in any spelling `normalize_worker_url` accepts."""
        worker = self._workers.get(key)
        if worker is not None:
            return worker
        try:
            url = normalize_worker_url(key)
        except ValueError:  # not a URL we would ever have admitted
            return None
        return self._workers.get(worker_id(url))

    def add(self, spec: WorkerSpec) -> Worker:
        if spec.id in self._workers:
            raise KeyError(f"worker {spec.url} already exists")
        worker = Worker(
            url=spec.url,
            id=spec.id,
            model=spec.model,
            capabilities=spec.capabilities,
            declared_capabilities=spec.capabilities,
            role=spec.role,
            configured_bootstrap_port=spec.bootstrap_port if spec.role == PREFILL else None,
        )
        self._workers[worker.id] = worker
        self._refresh()
        return worker

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._refresh()
        return worker

    def record_probe(
        self, worker: Worker, status: int | None, error: str | None, problem: str | None = None
    ) -> None:
        """Account one health probe: success only for status 200 without a `problem` (a
        worker that answers but cannot serve as configured, e.g. a prefill worker with no
        known bootstrap port)."""
        if worker.health is HealthState.DEAD or worker.id not in self._workers:
            return
        worker.last_check_time = time.time()
        worker.last_status = status
        if problem is not None:
            error, status = problem, None
        if status == 200:
            worker.last_error = None
            worker.consecutive_failures = 0
            worker.consecutive_successes += 1
            if (
                worker.health is not HealthState.HEALTHY
                and worker.consecutive_successes >= self.success_threshold
            ):
                self._set_health(worker, HealthState.HEALTHY)
        else:
            worker.last_error = error or f"probe answered {status}"
            self._count_failure(worker)

    def record_capabilities(self, worker: Worker, reported: frozenset[str] | None) -> None:
        """What the worker says it serves (None: it does not say); declared ones still win."""
        if worker.reported_capabilities != reported:
            logger.info(
                "worker %s reports capabilities %s",
                worker.url,
                "none" if reported is None else sorted(reported),
            )
        worker.reported_capabilities = reported
        self._apply_capabilities(worker)

    def _apply_capabilities(self, worker: Worker) -> None:
        declared = worker.declared_capabilities
        worker.capabilities = declared if declared is not None else worker.reported_capabilities

    def record_request(
        self,
        worker: Worker,
        status: int | None,
        error: str | None = None,
        *,
        is_request_fault: bool = False,
    ) -> None:
        """Account one routed request: connection errors and 408/429/5xx are failures.

        A 5xx the replica blamed on the request (`is_request_fault`) is not: like a 4xx,
        it shows a worker that answers, so it breaks the failure streak instead.
        """
        if status is not None and (is_request_fault or not is_failure_status(status)):
            worker.consecutive_failures = 0
            return
        worker.last_status = status
        worker.last_error = error or f"request answered {status}"
        if worker.health is not HealthState.DEAD:
            self._count_failure(worker)

    def update(self, worker: Worker, changes: dict) -> None:
        """Apply a management update: disabled, dead, recover, model, capabilities."""
        unknown = set(changes) - {"disabled", "dead", "recover", "model", "capabilities"}
        if unknown:
            raise ValueError(
                f"unknown fields {short_repr(sorted(map(str, unknown)))} (disabled, dead, recover, model, capabilities)"
            )
        for key in ("disabled", "dead", "recover"):
            if key in changes and not isinstance(changes[key], bool):
                raise ValueError(f"{key}: must be true or false")
        if "model" in changes or "capabilities" in changes:
            merged = {"url": worker.url, "model": worker.model, "capabilities": None}
            if worker.declared_capabilities is not None:
                merged["capabilities"] = sorted(worker.declared_capabilities)
            merged.update({k: changes[k] for k in ("model", "capabilities") if k in changes})
            spec = worker_spec_from_dict(merged)
            worker.model, worker.declared_capabilities = spec.model, spec.capabilities
            self._apply_capabilities(worker)
        if "disabled" in changes:
            worker.disabled = changes["disabled"]
        if changes.get("dead") is True:
            self._set_health(worker, HealthState.DEAD)
        elif changes.get("dead") is False or changes.get("recover") is True:
            self.reset(worker)
        self._refresh()

    def reset(self, worker: Worker) -> None:
        """Back to `unknown` with clean streaks; the caller probes it at once."""
        worker.consecutive_failures = worker.consecutive_successes = 0
        self._set_health(worker, HealthState.UNKNOWN)

    def _count_failure(self, worker: Worker) -> None:
        worker.num_failures += 1
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        if (
            worker.health is not HealthState.UNHEALTHY
            and worker.consecutive_failures >= self.failure_threshold
        ):
            self._set_health(worker, HealthState.UNHEALTHY)

    def _set_health(self, worker: Worker, health: HealthState) -> None:
        if worker.health is health:
            return
        logger.info("worker %s: %s -> %s", worker.url, worker.health.value, health.value)
        worker.health = health
        self._refresh()

    def _refresh(self) -> None:
        self._routable = tuple(w for w in self._workers.values() if w.is_routable)
