"""Prometheus metrics of a front process, under SGLang's names so its dashboards work.

What the front sees is counted here: requests, prompt and generated tokens, time to first
token, inter-token latency, end-to-end latency, and responses by protocol and status. The
scheduler's gauges (running and queued requests, token usage, cache hit rate, generation
throughput) are not kept here: `/metrics` asks the scheduler for them at scrape time
(`render`), so they are never stale and never counted twice.

With several front processes (`--api-workers`), each writes its values to files in
`PROMETHEUS_MULTIPROC_DIR` (set by the launcher, inside the server's private socket
directory, so nothing is left behind) and a scrape on any of them adds up all of them
(prometheus-client's multiprocess mode). With one front the values stay in memory.

The collectors are per process (one set, labelled by model name), so several in-process
engines in one program share them without registering anything twice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Buckets as SGLang's (seconds).
TTFT_BUCKETS = (0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1,
    0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 150, 200, 250, 300, 350,
    500, 1000,
)  # fmt: skip

# The scheduler's gauges, from its load report: metric name -> (load key, help).
SCHEDULER_GAUGES = {
    "sglang:num_running_reqs": ("num_running_reqs", "Requests in the running batch."),
    "sglang:num_queue_reqs": ("num_waiting_reqs", "Requests waiting for admission."),
    "sglang:num_used_tokens": ("num_used_tokens", "KV tokens held by live requests."),
    "sglang:token_usage": ("token_usage", "Fraction of the KV pool held by live requests."),
    "sglang:cache_hit_rate": (
        "cache_hit_rate",
        "Fraction of admitted prompt tokens served from the prefix cache.",
    ),
    "sglang:gen_throughput": ("gen_throughput", "Recent generation throughput (tokens/s)."),
    "sglang:max_total_num_tokens": ("max_total_num_tokens", "KV pool capacity in tokens."),
    "sglang:spec_accept_length": (
        "spec_accept_length",
        "Tokens a speculative verify step gives a request on average (recent steps).",
    ),
    "sglang:spec_accept_rate": (
        "spec_accept_rate",
        "Share of drafted tokens accepted (recent verify steps).",
    ),
}


def is_multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class _Collectors:
    def __init__(self):
        # Multiprocess mode: values live in files; nothing needs registering in this process.
        self.registry = None if is_multiprocess() else CollectorRegistry(auto_describe=True)
        reg = self.registry
        model = ["model_name"]
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Prompt tokens of finished requests.", model, registry=reg
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens",
            "Generated tokens of finished requests.",
            model,
            registry=reg,
        )
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "Prompt tokens served from the prefix cache.",
            model,
            registry=reg,
        )
        self.num_requests = Counter(
            "sglang:num_requests", "Generation requests that ended, however.", model, registry=reg
        )
        self.num_aborted = Counter(
            "sglang:num_aborted_requests",
            "Generation requests that ended aborted.",
            model,
            registry=reg,
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to the first generated token.",
            model,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Time between generated tokens (a chunk of k tokens counts k gaps of 1/k of it).",
            model,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Time from a request's arrival to its end.",
            model,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.faults = Counter(
            "cadence_request_faults",
            "Requests that ended in an internal error of their own (isolated: the server "
            "went on), by where it happened.",
            ["origin"],
            registry=reg,
        )
        self.responses = Counter(
            "cadence:responses",
            "Responses by protocol (http, grpc) and status (HTTP status or gRPC code).",
            ["protocol", "status"],
            registry=reg,
        )
        self.errors = Counter(
            "cadence:request_errors",
            "Error responses by protocol and status (HTTP >= 400, gRPC not OK).",
            ["protocol", "status"],
            registry=reg,
        )
        self._per_model: dict[str, _ModelMetrics] = {}

    def of(self, model: str) -> _ModelMetrics:
        """The per-request metrics of `model`, labelled once (labels() takes a lock and a
        lookup: a cost paid on every streamed token otherwise)."""
        found = self._per_model.get(model)
        if found is None:
            found = self._per_model[model] = _ModelMetrics(self, model)
        return found


class _ModelMetrics:
    __slots__ = (
        "ttft",
        "itl",
        "e2e",
        "num_requests",
        "num_aborted",
        "prompt_tokens",
        "generation_tokens",
        "cached_tokens",
    )

    def __init__(self, c: _Collectors, model: str):
        self.ttft = c.ttft.labels(model)
        self.itl = c.itl.labels(model)
        self.e2e = c.e2e.labels(model)
        self.num_requests = c.num_requests.labels(model)
        self.num_aborted = c.num_aborted.labels(model)
        self.prompt_tokens = c.prompt_tokens.labels(model)
        self.generation_tokens = c.generation_tokens.labels(model)
        self.cached_tokens = c.cached_tokens.labels(model)


_collectors: _Collectors | None = None


def collectors() -> _Collectors:
    global _collectors
    if _collectors is None:
        _collectors = _Collectors()
    return _collectors


def record_fault(origin: str) -> None:
    collectors().faults.labels(origin).inc()


def record_response(protocol: str, status: int | str) -> None:
    """One answered request of an adapter (an HTTP status, or a gRPC code name)."""
    c = collectors()
    label = str(status)
    c.responses.labels(protocol, label).inc()
    if (isinstance(status, int) and status >= 400) or (isinstance(status, str) and status != "OK"):
        c.errors.labels(protocol, label).inc()


class RequestTimer:
    """One generation request's timings, fed by the tokenizer manager as outputs arrive."""

    __slots__ = ("created", "last", "model")

    def __init__(self, model: str, created: float):
        self.model, self.created = model, created
        self.last: float | None = None  # when the previous tokens came

    def on_tokens(self, num: int, now: float) -> None:
        if num <= 0:
            return
        m = collectors().of(self.model)
        if self.last is None:
            m.ttft.observe(now - self.created)
            num -= 1
        elif num:
            gap = (now - self.last) / num
            for _ in range(num):
                m.itl.observe(gap)
        self.last = now

    def on_finish(self, meta: dict[str, Any], now: float) -> None:
        m = collectors().of(self.model)
        m.num_requests.inc()
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort":
            m.num_aborted.inc()
        m.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        m.generation_tokens.inc(meta.get("completion_tokens", 0))
        m.cached_tokens.inc(meta.get("cached_tokens", 0))
        m.e2e.observe(now - self.created)


def render(load: dict[str, Any] | None, model: str, extra: Sequence[str] = ()) -> bytes:
    """The /metrics body: the front processes' metrics (all of them in multiprocess mode),
    the scheduler's gauges from `load` (one /v1/loads entry), and `extra` lines."""
    registry = None if is_multiprocess() else collectors().registry
    if registry is None:  # multiprocess mode: every front process's values, from their files
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    body = generate_latest(registry).decode()
    lines = [body.rstrip("\n")] if body.strip() else []
    if load is not None:
        for name, (key, help_text) in SCHEDULER_GAUGES.items():
            if load.get(key) is not None:
                lines += [
                    f"# HELP {name} {help_text}",
                    f"# TYPE {name} gauge",
                    f'{name}{{model_name="{_escape(model)}"}} {float(load[key])}',
                ]
    lines += list(extra)
    return ("\n".join(lines) + "\n").encode()


CONTENT_TYPE = CONTENT_TYPE_LATEST


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def mark_process_dead(pid: int) -> None:
    """A front process ended: its live gauges stop counting (multiprocess mode)."""
    if is_multiprocess():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
