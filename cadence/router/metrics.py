"""Prometheus metrics of one router, in its own CollectorRegistry.

A registry per router keeps several routers in one process (tests) from colliding.
The hot path only bumps plain integers (requests, retries, a latency histogram's
buckets); per-worker figures are the live fields of `Worker`. Everything becomes
Prometheus metric families when /metrics is scraped, on the same event loop thread, so
a scrape never sees a half-applied update and no request takes a lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cadence.router.workers import HealthState, Worker

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Histogram:
    __slots__ = ("counts", "total", "num")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # last: above every bound (+Inf)
        self.total = 0.0
        self.num = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1
        self.total += value
        self.num += 1

    def cumulative(self) -> list[tuple[str, int]]:
        buckets, running = [], 0
        for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts):
            running += count
            buckets.append((bound, running))
        return buckets


class RouterMetrics:
    """Requests, latency, per-worker selections/failures/health/active, retries, in flight."""

    def __init__(
        self, workers: Callable[[], Iterable[Worker]], in_flight: Callable[[], int]
    ) -> None:
        self._workers = workers
        self._in_flight = in_flight
        self._requests: dict[tuple[str, int], int] = {}
        self._latency: dict[str, _Histogram] = {}
        self._retries: dict[str, int] = {}
        # PD mode: requests sent to each side, and those that side failed, by (role, url).
        self._pd_requests: dict[tuple[str, str], int] = {}
        self._pd_failures: dict[tuple[str, str], int] = {}
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        self._requests[key] = self._requests.get(key, 0) + 1
        histogram = self._latency.get(route)
        if histogram is None:
            histogram = self._latency[route] = _Histogram()
        histogram.observe(seconds)

    def observe_retry(self, route: str) -> None:
        self._retries[route] = self._retries.get(route, 0) + 1

    def observe_pd_request(self, role: str, url: str) -> None:
        key = (role, url)
        self._pd_requests[key] = self._pd_requests.get(key, 0) + 1

    def observe_pd_failure(self, role: str, url: str) -> None:
        key = (role, url)
        self._pd_failures[key] = self._pd_failures.get(key, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """Called by prometheus_client at scrape time."""
        requests = CounterMetricFamily(
            "cadence_router_requests",
            "Requests answered, by route and status.",
            labels=["route", "status"],
        )
        for (route, status), count in sorted(self._requests.items()):
            requests.add_metric([route, str(status)], count)
        yield requests
        latency = HistogramMetricFamily(
            "cadence_router_request_duration_seconds",
            "Time from request received to the last byte relayed, by route.",
            labels=["route"],
        )
        for route, histogram in sorted(self._latency.items()):
            latency.add_metric([route], histogram.cumulative(), histogram.total)
        yield latency
        retries = CounterMetricFamily("cadence_router_retries", "Retries after a failed attempt, by route.",
                                      labels=["route"])  # fmt: skip
        for route, count in sorted(self._retries.items()):
            retries.add_metric([route], count)
        yield retries
        yield GaugeMetricFamily(
            "cadence_router_active_requests",
            "Requests in progress in the router.",
            value=self._in_flight(),
        )
        yield from self._collect_workers()
        yield from self._collect_pd()

    def _collect_pd(self) -> Iterator[Metric]:
        if not self._pd_requests:
            return
        requests = CounterMetricFamily(
            "cadence_router_pd_requests",
            "PD mode: requests sent to each worker, by its role (prefill or decode).",
            labels=["role", "worker"],
        )
        for (role, url), count in sorted(self._pd_requests.items()):
            requests.add_metric([role, url], count)
        failures = CounterMetricFamily(
            "cadence_router_pd_failures",
            "PD mode: requests a worker failed (connection error, timeout, 408, 429, 5xx not "
            "blamed on the request), by its role.",
            labels=["role", "worker"],
        )
        for (role, url), count in sorted(self._pd_failures.items()):
            failures.add_metric([role, url], count)
        yield from (requests, failures)

    def _collect_workers(self) -> Iterator[Metric]:
        selections = CounterMetricFamily(
            "cadence_router_worker_selections", "Attempts routed to each worker.", labels=["worker"]
        )
        failures = CounterMetricFamily(
            "cadence_router_worker_failures",
            "Failed probes and failed requests (connection errors, 408, 429, 5xx not blamed on the request)"
            " of each worker.",
            labels=["worker"],
        )
        active = GaugeMetricFamily(
            "cadence_router_worker_active_requests",
            "Requests in progress on each worker.",
            labels=["worker"],
        )
        health = GaugeMetricFamily(
            "cadence_router_worker_health",
            "1 for the current health state of each worker.",
            labels=["worker", "state"],
        )
        routable = GaugeMetricFamily(
            "cadence_router_worker_routable",
            "1 when the worker is healthy and not disabled.",
            labels=["worker"],
        )
        for worker in self._workers():
            selections.add_metric([worker.url], worker.num_requests)
            failures.add_metric([worker.url], worker.num_failures)
            active.add_metric([worker.url], worker.active)
            routable.add_metric([worker.url], int(worker.is_routable))
            for state in HealthState:
                health.add_metric([worker.url, state.value], int(worker.health is state))
        yield from (selections, failures, active, health, routable)
