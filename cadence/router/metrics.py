"""Prometheus metrics of one router, in its own CollectorRegistry.

A registry per router keeps several routers in one process (tests) from colliding.
Hot-path children (per route and status, per worker) are looked up once and cached;
gauges of active requests read the live counters when scraped instead of being
updated on every request.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from cadence.router.workers import HealthState, Worker

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0, float("inf"),
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """Requests, latency, selections, health, retries and active requests."""

    def __init__(self, in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self._init_metrics()
        self.in_flight.set_function(in_flight)
        self._request_children: dict[tuple[str, int], tuple] = {}
        self._selection_children: dict[str, Counter] = {}

    def _init_metrics(self) -> None:
        r = self.registry
        self.requests = Counter(
            "cadence_router_requests", "Requests answered, by route and status.",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "cadence_router_request_duration_seconds",
            "Time from request received to the last byte relayed, by route.",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.selections = Counter(
            "cadence_router_worker_selections", "Attempts routed to each worker.",
            ["worker"], registry=r,
        )  # fmt: skip
        self.failures = Counter(
            "cadence_router_worker_failures",
            "Failed requests counted against each worker (connection errors, 408, 429, 5xx).",
            ["worker"], registry=r,
        )  # fmt: skip
        self.health = Enum(
            "cadence_router_worker_health", "Health state of each worker.", ["worker"],
            states=[s.value for s in HealthState], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "cadence_router_retries", "Retries after a failed attempt, by route.",
            ["route"], registry=r,
        )  # fmt: skip
        self.active = Gauge(
            "cadence_router_worker_active_requests", "Requests in progress on each worker.",
            ["worker"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "cadence_router_active_requests", "Requests in progress in the router.",
            registry=r,
        )  # fmt: skip

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        children = self._request_children.get((route, status))
        if children is None:
            children = (self.requests.labels(route, str(status)), self.latency.labels(route))
            self._request_children[(route, status)] = children
        children[0].inc()
        children[1].observe(seconds)

    def observe_selection(self, worker: Worker) -> None:
        child = self._selection_children.get(worker.id)
        if child is None:
            child = self.selections.labels(worker.url)
            self._selection_children[worker.id] = child
        child.inc()

    def observe_failure(self, worker: Worker) -> None:
        self.failures.labels(worker.url).inc()

    def observe_retry(self, route: str) -> None:
        self.retries.labels(route).inc()

    def worker_added(self, worker: Worker) -> None:
        self.active.labels(worker.url).set_function(lambda: worker.active)
        self.health.labels(worker.url).state(worker.health.value)

    def health_changed(self, worker: Worker) -> None:
        self.health.labels(worker.url).state(worker.health.value)

    def worker_removed(self, worker: Worker) -> None:
        self._selection_children.pop(worker.id, None)
        for metric in (self.selections, self.failures, self.health, self.active):
            try:
                metric.remove(worker.url)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
