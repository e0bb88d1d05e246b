"""The router process: an aiohttp server in front of an aiohttp client session.

The stack was chosen by measurement (benchmarks/bench_router.py): an aiohttp server
relaying through one pooled aiohttp ClientSession adds a fraction of a millisecond,
where an ASGI framework with httpx costs several times more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from cadence.router import admin
from cadence.router.access import AccessControl, Handler, client_key_middleware
from cadence.router.config import DECODE, PREFILL, RouterConfig, WorkerSpec, short_repr
from cadence.router.discovery import PodDiscovery
from cadence.router.health import HealthChecker
from cadence.router.kv_index import KvEventIndex, tokens_for_routing
from cadence.router.metrics import RouterMetrics
from cadence.router.pd_proxy import PD_ROUTES, PdForwarder
from cadence.router.policies import CacheAwarePolicy, RoutingPolicy, make_policy
from cadence.router.proxy import (
    CLIENT_CLOSED,
    Exchange,
    Forwarder,
    error_response,
    payload_too_large,
    read_body,
    request_id,
)
from cadence.router.request_meta import ROUTE_CAPABILITIES, parse_route_meta
from cadence.router.route_log import RouteLog
from cadence.router.workers import Worker, WorkerRegistry

logger = logging.getLogger("cadence.router")


class Router:
    """Owns the workers, the policy, the probes, the client session and the HTTP server."""

    def __init__(self, config: RouterConfig, specs: list[WorkerSpec]) -> None:
        self.config = config
        self.num_in_flight = 0  # requests being routed now (for 429 and metrics)
        self.access = AccessControl(config)
        self._init_observability()
        self._init_workers(specs)
        self.policy = make_policy(config)
        # PD mode: each side has its own policy (and its own round-robin turn, tree, ...).
        self.pd_policies: dict[str, RoutingPolicy] = {}
        if config.pd_disaggregation:
            self.pd_policies = {
                role: make_policy(config, config.policy_for(role)) for role in (PREFILL, DECODE)
            }
        self.session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None
        self.forwarder: Forwarder | None = None
        self.pd: PdForwarder | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.discovery: PodDiscovery | None = None

    def _init_observability(self) -> None:
        self.metrics = RouterMetrics(
            workers=lambda: self.registry, in_flight=lambda: self.num_in_flight
        )
        self.route_log = RouteLog(self.config.route_log)

    def _init_workers(self, specs: list[WorkerSpec]) -> None:
        self.registry = WorkerRegistry(
            success_threshold=self.config.health_success_threshold,
            failure_threshold=self.config.health_failure_threshold,
        )
        for spec in specs:
            self.registry.add(spec)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Open the client session, start the probes, listen. Call inside the event loop."""
        self.session = make_client_session()
        self.health = HealthChecker(self.config, self.registry, self.session)
        self.forwarder = Forwarder(
            self.config, self.registry, self.policy, self.metrics, self.session
        )
        if self.config.pd_disaggregation:
            self.pd = PdForwarder(
                self.config, self.registry, self.pd_policies, self.metrics, self.session
            )
        elif isinstance(self.policy, CacheAwarePolicy):
            # KV events tell where a prompt's pages are; in PD mode that is the prefill
            # side, whose cache_aware policy keeps its own prefix tree instead.
            self.policy.kv_index = KvEventIndex(self.session)
        self._runner = web.AppRunner(self.build_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=2048)
        await self._site.start()
        for worker in self.registry:
            self.health.watch(worker)
            self._watch_kv_events(worker)
        if self.config.service_discovery:  # loads the Kubernetes client (only then)
            self.discovery = PodDiscovery(self.config, self)
            await self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        index = getattr(self.policy, "kv_index", None)
        if index is not None:
            await index.close()
        if self.health is not None:
            await self.health.stop()
        if self.pd is not None:
            await self.pd.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.session is not None:
            await self.session.close()
        self.route_log.close()

    @property
    def port(self) -> int:
        """The port actually bound (differs from config.port when that is 0)."""
        assert self._runner is not None, "router not started"
        return self._runner.addresses[0][1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    # -- workers -----------------------------------------------------------------------

    def add_worker(self, spec: WorkerSpec) -> Worker:
        """Add a worker in state `unknown` and probe it at once. KeyError if present."""
        worker = self.registry.add(spec)
        if self.health is not None:
            self.health.watch(worker)
            self._watch_kv_events(worker)
        return worker

    def _watch_kv_events(self, worker: Worker) -> None:
        index = getattr(self.policy, "kv_index", None)
        if index is not None:
            index.watch(worker.id, worker.url)

    async def remove_worker(self, worker: Worker) -> None:
        """Stop routing to and probing `worker`; its requests in progress finish."""
        self.registry.remove(worker.id)
        for policy in (self.policy, *self.pd_policies.values()):
            policy.remove_worker(worker.id)
        if self.health is not None:
            await self.health.unwatch(worker)

    def update_worker(self, worker: Worker, changes: dict) -> None:
        """Apply a management update; a recovered worker is probed at once."""
        self.registry.update(worker, changes)
        recovered = changes.get("recover") is True or changes.get("dead") is False
        if recovered and self.health is not None:
            self.health.wake(worker)

    # -- HTTP --------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        middlewares = [json_errors]
        if self.access.has_client_key:  # no per-request cost when there is no key to check
            middlewares.append(client_key_middleware(self.access))
        # +1: aiohttp refuses a body whose size equals client_max_size.
        app = web.Application(
            client_max_size=self.config.max_payload_size + 1, middlewares=middlewares
        )
        for path in ROUTE_CAPABILITIES:
            app.router.add_post(path, self._proxy_handler(path))
        admin.add_routes(app, self)
        return app

    def _proxy_handler(self, route: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            ex = Exchange(rid=request_id(request), route=route)
            status = 500
            try:
                response = await self._proxy(request, ex)
                status = CLIENT_CLOSED if ex.is_client_gone else response.status
                return response
            except asyncio.CancelledError:  # the client went away; aiohttp cancelled us
                status = CLIENT_CLOSED
                raise
            finally:
                elapsed = time.perf_counter() - started
                self.metrics.observe_request(route, status, elapsed)
                if self.route_log.is_enabled:
                    self.route_log.write(_route_record(ex, status, elapsed, self.config.policy))

        return handle

    async def _proxy(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        if self.pd is not None and ex.route not in PD_ROUTES:
            return error_response(
                501,
                f"{ex.route} is not served in PD mode (--pd-disaggregation): only "
                f"{', '.join(sorted(PD_ROUTES))} are; route it through a router in front of "
                "complete replicas",
                ex.rid,
                "not_implemented",
            )
        limit = self.config.max_payload_size
        length = request.content_length
        if length is not None and length > limit:
            return _too_large(limit, ex.rid)
        max_concurrent = self.config.max_concurrent_requests
        if max_concurrent and self.num_in_flight >= max_concurrent:
            response = error_response(
                429,
                f"router is at its limit of {max_concurrent} concurrent requests; retry later",
                ex.rid,
                "overloaded",
            )
            response.headers["Retry-After"] = "1"
            return response
        self.num_in_flight += 1
        try:
            body = await read_body(request, limit)
            if body is None:
                return _too_large(limit, ex.rid)
            ex.meta = parse_route_meta(ex.route, body)
            if self.pd is not None:
                return await self.pd.forward(request, body, ex)
            await self._add_token_ids(ex, body)
            assert self.forwarder is not None
            return await self.forwarder.forward(request, body, ex)
        finally:
            self.num_in_flight -= 1

    async def _add_token_ids(self, ex: Exchange, body: bytes) -> None:
        """cache_aware over KV events: the prompt's token ids, from a worker that publishes
        events (none when no fitting worker does: the policy uses its own tree then)."""
        index = getattr(self.policy, "kv_index", None)
        if index is None or ex.route not in TOKENIZED_ROUTES or self.session is None:
            return
        meta = ex.meta
        known = [
            w
            for w in self.registry.routable
            if w.id in index.block_size and w.can_serve(meta.model, meta.capabilities)
        ]
        if known:
            tokens = await tokens_for_routing(self.session, known[0].url, ex.route, body)
            if tokens:
                ex.meta = dataclasses.replace(meta, token_ids=tuple(tokens))


TOKENIZED_ROUTES = frozenset(("/generate", "/v1/completions", "/v1/chat/completions"))


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error the router answers itself is a JSON error body, never aiohttp's plain text.

    aiohttp's own errors (404 for an unknown path, 405, 413 over client_max_size) keep
    their status and headers; an unexpected exception is logged with its traceback and
    answered 500. Once part of an answer has been sent nothing else can be: the
    exception goes on to aiohttp, which closes the connection.
    """
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except Exception:
        rid = request_id(request)
        if request.writer.output_size > 0:
            raise
        logger.exception(
            "unexpected error answering %s %s (request %s)", request.method, request.path, rid
        )
        response = error_response(
            500,
            f"internal router error; the router's log has the details (request {rid})",
            rid,
            "internal_error",
        )
        response.force_close()  # the request may not have been read to its end
        return response


_HTTP_ERROR_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    path = short_repr(request.path)
    if exc.status == 404:
        message = f"no route {request.method} {path}; see docs/router.md for the routes"
    elif exc.status == 405:
        message = (
            f"{request.method} is not allowed on {path}; allowed: {exc.headers.get('Allow', '')}"
        )
    else:
        message = exc.text or exc.reason
    response = error_response(
        exc.status, message, request_id(request), _HTTP_ERROR_KINDS.get(exc.status, "http_error")
    )
    for name in ("Allow", "Retry-After"):
        if name in exc.headers:
            response.headers[name] = exc.headers[name]
    if exc.status == 413:
        response.force_close()
    return response


def _too_large(limit: int, rid: str) -> web.Response:
    return payload_too_large(
        f"request body is larger than the router's limit of {limit} bytes (--max-payload-size)", rid
    )


# How long an idle pooled connection to a worker may be reused. Below the workers' own
# keep-alive (uvicorn's 5 s, which Cadence and SGLang servers keep): a connection the worker
# may be closing at that moment is never picked, so a request is never written into it and
# lost as a 502 ("Can not write request body"), which no retry saves with one worker a role.
UPSTREAM_KEEPALIVE_S = 3.0


def make_client_session() -> aiohttp.ClientSession:
    """One pooled session for every upstream call, set up for faithful relaying."""
    connector = aiohttp.TCPConnector(
        limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_KEEPALIVE_S
    )
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,  # relay compressed bytes as they are
        cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        timeout=aiohttp.ClientTimeout(total=None),
    )


def _route_record(ex: Exchange, status: int, elapsed: float, policy: str) -> dict:
    return {
        "time": time.time(),
        "rid": ex.rid,
        "route": ex.route,
        "model": ex.meta.model,
        "stream": ex.meta.is_stream,
        "policy": policy,
        "worker": ex.worker.url if ex.worker is not None else None,
        "prefill_worker": ex.prefill_worker.url if ex.prefill_worker is not None else None,
        "attempts": ex.num_attempts,
        "status": status,
        "duration_ms": round(elapsed * 1000.0, 3),
    }


async def run_router(config: RouterConfig, specs: list[WorkerSpec], stop: asyncio.Event) -> None:
    """Serve until `stop` is set."""
    router = Router(config, specs)
    try:
        await router.start()
        if config.pd_disaggregation:
            logger.info(
                "cadence router listening on %s in PD mode: %d prefill, %d decode worker(s), "
                "policies %s / %s",
                router.url,
                sum(w.role == PREFILL for w in router.registry),
                sum(w.role == DECODE for w in router.registry),
                config.policy_for(PREFILL),
                config.policy_for(DECODE),
            )
        else:
            logger.info(
                "cadence router listening on %s: %d worker(s), policy %s",
                router.url,
                len(router.registry),
                config.policy,
            )
        await stop.wait()
    finally:
        await router.stop()  # also after a failed start: the client session is closed
