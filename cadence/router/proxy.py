"""Forwarding one request: choose a worker, send the original bytes, relay the answer.

A request may be retried on another worker only while nothing of the answer has reached
the client: after a connection error, or an answer of 408/429/500/502/503/504 that is
then discarded. Never after any other 4xx, nor after a 5xx the replica marks
`X-Cadence-Fault: request` (the request itself made it fail: another worker would fail
the same way); such an answer is relayed as it is. Once a streamed answer's headers are
sent it is relayed to the end or cut, never replayed. Every attempt counts itself on
its worker and releases the count in a `finally`, so success, upstream failure, client
disconnect and cancellation all give it back.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from cadence.router.config import RouterConfig, short_repr
from cadence.router.metrics import RouterMetrics
from cadence.router.policies import RoutingPolicy
from cadence.router.request_meta import RouteMeta
from cadence.router.workers import Worker, WorkerRegistry

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Host and Content-Length are set anew for the upstream connection.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# A replica marks a 5xx caused by the request itself (not by its own state) this way.
FAULT_HEADER = "X-Cadence-Fault"
# Answers without a length, event streams, or longer than this are relayed chunk by chunk.
_BUFFER_LIMIT = 1 << 20
REQUEST_ID_HEADER = "x-cadence-request-id"
WORKER_HEADER = "x-cadence-worker"
CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; metrics and log only
_RID_KEY = web.RequestKey("cadence_rid", str)

_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class Exchange:
    """What happened to one request, for metrics and the route log."""

    rid: str
    route: str
    meta: RouteMeta = field(default_factory=RouteMeta)
    worker: Worker | None = None  # the one that answered (PD mode: the decode worker)
    prefill_worker: Worker | None = None  # PD mode
    num_attempts: int = 0
    is_client_gone: bool = False


class _AttemptFailed(Exception):
    """An attempt failed before anything reached the client; another may be made."""


def error_response(status: int, message: str, rid: str, kind: str, **extra) -> web.Response:
    """A JSON error in the OpenAI shape, made by the router itself."""
    error = {"message": message, "type": kind, "code": status, **extra}
    return web.Response(
        status=status,
        body=_encoder.encode({"error": error}),
        content_type="application/json",
        headers={REQUEST_ID_HEADER: rid},
    )


def payload_too_large(message: str, rid: str) -> web.Response:
    """413 for a body that was refused before being read whole."""
    response = error_response(413, message, rid, "payload_too_large")
    response.force_close()  # the unread rest of the body must not be parsed as a request
    return response


async def read_body(request: web.Request, limit: int) -> bytes | None:
    """The whole body, or None when it is longer than `limit` bytes.

    A declared Content-Length over the limit is refused before reading; a body without
    one (chunked) is read at most `limit + 1` bytes far.
    """
    length = request.content_length
    if length is not None:
        return None if length > limit else await request.read()
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await request.content.read(limit + 1 - size)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        chunks.append(chunk)
    return None


def request_id(request: web.Request) -> str:
    """The client's x-request-id when it is reasonable, else a fresh one; the same all request long."""
    rid = request.get(_RID_KEY)
    if rid is None:
        given = request.headers.get("x-request-id")
        rid = given if given and len(given) <= 128 and given.isprintable() else os.urandom(16).hex()
        request[_RID_KEY] = rid
    return rid


def forward_headers(headers: CIMultiDictProxy[str], rid: str) -> CIMultiDict[str]:
    """Request headers for the upstream: hop-by-hop ones (and those Connection names) dropped."""
    out = CIMultiDict(headers)
    _drop(out, _REQUEST_DROP)
    out[REQUEST_ID_HEADER] = rid
    return out


def relay_headers(upstream: aiohttp.ClientResponse, rid: str, worker: Worker) -> CIMultiDict[str]:
    """Response headers for the client: the upstream's minus hop-by-hop, plus diagnostics."""
    out = CIMultiDict(upstream.headers)
    _drop(out, _RESPONSE_DROP)
    out[REQUEST_ID_HEADER] = rid
    out[WORKER_HEADER] = worker.url
    return out


def _drop(headers: CIMultiDict[str], names: frozenset[str]) -> None:
    """Remove `names` and whatever the Connection header names (case-insensitive lookups)."""
    connection = headers.get("Connection")
    if connection:
        for token in connection.split(","):
            headers.popall(token.strip(), None)
    for name in names:
        if name in headers:
            del headers[name]


def is_request_fault(status: int, headers: CIMultiDictProxy[str]) -> bool:
    """A 5xx the replica blames on the request (X-Cadence-Fault: request): never retried."""
    return status >= 500 and headers.get(FAULT_HEADER, "").strip().lower() == "request"


def backoff_secs(config: RouterConfig, rng: random.Random, retry: int) -> float:
    """Delay before retry number `retry` (1-based): exponential, capped, jittered."""
    delay = config.retry_initial_backoff_secs * config.retry_backoff_multiplier ** (retry - 1)
    delay = min(delay, config.retry_max_backoff_secs)
    jitter = config.retry_jitter_factor * rng.uniform(-1.0, 1.0)
    return max(0.0, delay * (1.0 + jitter))


def is_streamed(upstream: aiohttp.ClientResponse) -> bool:
    """Relayed chunk by chunk (an event stream, no length, or long) rather than read whole."""
    length = upstream.content_length
    if length is None or length > _BUFFER_LIMIT:
        return True
    return upstream.content_type == "text/event-stream"


class Forwarder:
    """Sends requests to workers with retries and relays the answers."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        policy: RoutingPolicy,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.session = session
        self.max_attempts = 1 + config.retry_max_retries
        self._timeout = aiohttp.ClientTimeout(total=config.request_timeout_secs)
        self._rng = rng or random.Random()

    def choose(self, meta: RouteMeta, tried: set[str]) -> Worker | None:
        """Apply the policy to the routable workers that fit, preferring untried ones."""
        candidates = [
            w for w in self.registry.routable if w.can_serve(meta.model, meta.capabilities)
        ]
        if not candidates:
            return None
        if tried:
            untried = [w for w in candidates if w.id not in tried]
            candidates = untried or candidates
        return self.policy.select(candidates, meta)

    def backoff_secs(self, retry: int) -> float:
        """Delay before retry number `retry` (1-based): exponential, capped, jittered."""
        return backoff_secs(self.config, self._rng, retry)

    async def forward(self, request: web.Request, body: bytes, ex: Exchange) -> web.StreamResponse:
        tried: set[str] = set()
        last_error = ""
        for attempt in range(self.max_attempts):
            if attempt:
                self.metrics.observe_retry(ex.route)
                await asyncio.sleep(self.backoff_secs(attempt))
            worker = self.choose(ex.meta, tried)
            if worker is None:
                break
            tried.add(worker.id)
            ex.worker, ex.num_attempts = worker, attempt + 1
            try:
                return await self._attempt(
                    worker, request, body, ex, attempt + 1 < self.max_attempts
                )
            except _AttemptFailed as exc:
                last_error = str(exc)
        if ex.num_attempts == 0:
            return self._no_worker(ex)
        return error_response(
            502,
            f"no worker answered after {ex.num_attempts} attempt(s); last error: {last_error}",
            ex.rid,
            "bad_gateway",
        )

    def _no_worker(self, ex: Exchange) -> web.Response:
        meta = ex.meta
        wanted = f"model {short_repr(meta.model)}" if meta.model else "any model"
        if meta.capabilities:
            wanted += f" with capabilities {sorted(meta.capabilities)}"
        return error_response(
            503,
            f"no healthy worker serves {wanted}; check GET /workers",
            ex.rid,
            "no_worker_available",
        )

    async def _attempt(
        self, worker: Worker, request: web.Request, body: bytes, ex: Exchange, may_retry: bool
    ) -> web.StreamResponse:
        """One try on one worker, counted on it from the first byte sent to the last relayed."""
        worker.active += 1
        worker.num_requests += 1
        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                upstream = await self.session.request(
                    request.method,
                    URL(worker.url + request.raw_path, encoded=True),
                    data=body,
                    headers=forward_headers(request.headers, ex.rid),
                    timeout=self._timeout,
                    allow_redirects=False,
                )
                status = upstream.status
                is_fault = is_request_fault(status, upstream.headers)
                self.registry.record_request(worker, status, is_request_fault=is_fault)
                if may_retry and status in RETRY_STATUSES and not is_fault:
                    raise _AttemptFailed(f"{worker.url} answered {status}")
                if is_streamed(upstream):
                    return await self._relay_stream(request, upstream, worker, ex)
                return await self._relay_buffered(upstream, worker, ex)
            except TimeoutError:
                self.registry.record_request(worker, None, "timed out")
                return error_response(
                    504,
                    f"worker {worker.url} did not answer within {self.config.request_timeout_secs}s",
                    ex.rid,
                    "gateway_timeout",
                )
            except (aiohttp.ClientError, OSError) as exc:
                self.registry.record_request(worker, None, repr(exc))
                raise _AttemptFailed(f"{worker.url}: {exc!r}") from None
        finally:
            worker.active -= 1
            if upstream is not None:
                if upstream.content.is_eof():
                    upstream.release()  # fully read: the connection goes back to the pool
                else:
                    upstream.close()  # cut short: the worker sees its connection closed

    async def _relay_buffered(
        self, upstream: aiohttp.ClientResponse, worker: Worker, ex: Exchange
    ) -> web.Response:
        """A short answer with a length: read it whole, send it in one piece."""
        data = await upstream.read()
        return web.Response(
            status=upstream.status,
            reason=upstream.reason,
            body=data,
            headers=relay_headers(upstream, ex.rid, worker),
        )

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        worker: Worker,
        ex: Exchange,
    ) -> web.StreamResponse:
        """Relay byte for byte as chunks arrive. Past `prepare` nothing is retried."""
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=relay_headers(upstream, ex.rid, worker),
        )
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        try:
            await response.prepare(request)
        except ConnectionResetError:
            ex.is_client_gone = True
            return response
        while True:
            try:
                chunk = await upstream.content.readany()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                # The client already has headers: cut its connection so the
                # truncation shows instead of a clean end of stream.
                self.registry.record_request(worker, None, f"stream broke: {exc!r}")
                if request.transport is not None:
                    request.transport.close()
                return response
            if not chunk:
                break
            try:
                await response.write(chunk)
            except ConnectionResetError:
                ex.is_client_gone = True
                return response
        await response.write_eof()
        return response
