"""PD mode: one generate request, two upstreams, the decode side's answer.

The router picks a prefill and a decode worker (each side with its own policy), writes
the bootstrap fields into the body (`pd_body`) and sends the same bytes to both at once.
The decode worker's answer is the client's: status, headers and body, streamed or not,
relayed as the normal path does. The prefill worker's answer is read and dropped, except
for native /generate with `return_logprob`, whose input logprobs are merged in.

Failures never leave a request waiting on a side that will not answer:

- A side that fails (connection refused or reset, 408/429/5xx, the request timeout)
  while the other is still at work ends the exchange: the other side's request is
  cancelled, which closes its connection (how a Cadence server learns that its client
  left: it aborts the request and frees its pages), and the client gets the router's
  JSON error naming the side and its URL (502; 504 for a timeout). Before anything
  reached the client, connection errors and 408/429/5xx are retried on a new pair.
- A 4xx (or a 5xx the worker blames on the request) from either side is the client's
  answer, relayed as it is; the other side is cancelled.
- Once the decode side's streamed answer has begun, a failure of either side ends the
  stream with a `data: {"error": ...}` event and a cut connection (never a clean end).
- The client leaving cancels both sides.
- Once the decode side has answered in full, a prefill request still running is left to
  finish (bounded by the request timeout): its worker may still be acknowledging the KV
  transfer. The router's shutdown cancels those.

Each side counts the request on its worker for as long as that side's request lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from cadence.router import pd_body
from cadence.router.config import DECODE, PREFILL, RouterConfig, short_repr
from cadence.router.metrics import RouterMetrics
from cadence.router.policies import RoutingPolicy
from cadence.router.proxy import (
    RETRY_STATUSES,
    Exchange,
    backoff_secs,
    error_response,
    forward_headers,
    is_request_fault,
    is_streamed,
    relay_headers,
)
from cadence.router.request_meta import RouteMeta
from cadence.router.workers import Worker, WorkerRegistry

PD_ROUTES = pd_body.GENERATE_ROUTES  # the others answer 501 in PD mode
PREFILL_WORKER_HEADER = "x-cadence-prefill-worker"
_ERROR_SNIPPET = 300  # characters of a failing worker's answer quoted in the router's error


class _SideFailed(Exception):
    """A side ended the exchange: `response` is the client's answer unless `is_retryable`
    (nothing reached the client yet and another pair may do better)."""

    def __init__(self, response: web.StreamResponse, message: str, is_retryable: bool) -> None:
        super().__init__(message)
        self.response = response
        self.message = message
        self.is_retryable = is_retryable


class PdForwarder:
    """Sends generate requests to a (prefill, decode) pair and relays the decode answer."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        policies: dict[str, RoutingPolicy],
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.policies = policies  # by role: prefill, decode
        self.metrics = metrics
        self.session = session
        self.max_attempts = 1 + config.retry_max_retries
        self._timeout = aiohttp.ClientTimeout(total=config.request_timeout_secs)
        self._rng = rng or random.Random()
        self._detached: set[asyncio.Task] = set()  # prefill requests outliving their exchange

    async def close(self) -> None:
        """Cancel the prefill requests still finishing in the background."""
        for task in list(self._detached):
            task.cancel()
        await asyncio.gather(*self._detached, return_exceptions=True)

    def choose(self, role: str, meta: RouteMeta, tried: set[str]) -> Worker | None:
        """The policy's pick among routable workers of `role` that fit, untried ones first."""
        candidates = [
            w
            for w in self.registry.routable
            if w.role == role and w.can_serve(meta.model, meta.capabilities)
        ]
        if not candidates:
            return None
        untried = [w for w in candidates if w.id not in tried]
        return self.policies[role].select(untried or candidates, meta)

    async def forward(self, request: web.Request, body: bytes, ex: Exchange) -> web.StreamResponse:
        try:
            obj = pd_body.decode_object(body)
        except pd_body.PdBodyError as exc:
            return error_response(400, str(exc), ex.rid, "invalid_request")
        if self._prefills_locally(ex.route, obj):
            return await self._forward_local(request, body, obj, ex)
        batch = pd_body.batch_size(ex.route, obj)
        wants_logprobs = pd_body.wants_input_logprobs(ex.route, obj)

        async def pair(picked: dict[str, Worker]) -> web.StreamResponse:
            prefill, decode = picked[PREFILL], picked[DECODE]
            host = pd_body.bootstrap_host(prefill.url)
            pd_body.inject_bootstrap(obj, host, prefill.bootstrap_port, batch, self._rng)
            data = pd_body.encode(obj)
            return await self._exchange(request, data, prefill, decode, ex, wants_logprobs)

        return await self._with_retries(ex, (PREFILL, DECODE), pair)

    async def _with_retries(
        self,
        ex: Exchange,
        roles: tuple[str, ...],
        run: Callable[[dict[str, Worker]], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """`run` with a worker of each role (untried ones first), again on new workers after
        a retryable failure, up to 1 + --retry-max-retries times; the answer, the last
        failure's, or 503 when a role has no routable worker."""
        tried: dict[str, set[str]] = {role: set() for role in roles}
        last: _SideFailed | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                self.metrics.observe_retry(ex.route)
                await asyncio.sleep(backoff_secs(self.config, self._rng, attempt))
            picked = {role: self.choose(role, ex.meta, tried[role]) for role in roles}
            missing = [role for role, worker in picked.items() if worker is None]
            if missing:
                return last.response if last is not None else self._no_pair(ex, missing)
            workers = {role: worker for role, worker in picked.items() if worker is not None}
            for role, worker in workers.items():
                tried[role].add(worker.id)
            ex.prefill_worker, ex.worker = workers.get(PREFILL), workers[DECODE]
            ex.num_attempts = attempt + 1
            try:
                return await run(workers)
            except _SideFailed as exc:
                if not exc.is_retryable or attempt + 1 == self.max_attempts:
                    return exc.response
                last = exc
        assert last is not None  # the loop returns unless it retried
        return last.response

    def _no_pair(self, ex: Exchange, missing: list[str]) -> web.Response:
        meta = ex.meta
        wanted = f"model {short_repr(meta.model)}" if meta.model else "any model"
        if meta.capabilities:
            wanted += f" with capabilities {sorted(meta.capabilities)}"
        return error_response(
            503,
            f"no healthy {' or '.join(missing)} worker serves {wanted}; PD mode needs one of "
            "each, check GET /workers",
            ex.rid,
            "no_worker_available",
        )

    # -- a short prompt, prefilled where it decodes ---------------------------------------

    def _prefills_locally(self, route: str, obj: dict) -> bool:
        """--pd-local-prefill-max-tokens: a prompt this short skips the prefill workers."""
        limit = self.config.pd_local_prefill_max_tokens
        if not limit:
            return False
        tokens = pd_body.prompt_tokens(route, obj)
        return tokens is not None and tokens <= limit

    async def _forward_local(
        self, request: web.Request, body: bytes, obj: dict, ex: Exchange
    ) -> web.StreamResponse:
        """A decode worker alone prefills and decodes the request (no room, no transfer), its
        answer relayed as a disaggregated one is; a failed worker is retried on another
        decode worker, by the same rules."""
        if pd_body.without_bootstrap(obj):
            body = pd_body.encode(obj)

        async def alone(picked: dict[str, Worker]) -> web.StreamResponse:
            return await self._local(request, body, picked[DECODE], ex)

        return await self._with_retries(ex, (DECODE,), alone)

    async def _local(
        self, request: web.Request, data: bytes, decode: Worker, ex: Exchange
    ) -> web.StreamResponse:
        headers = forward_headers(request.headers, ex.rid)
        decode.active += 1
        decode.num_requests += 1
        upstream: aiohttp.ClientResponse | None = None
        try:
            upstream = await self._open_decode(decode, request, data, headers, ex)
            if is_streamed(upstream):
                response, _ = await self._relay_stream(request, upstream, decode, None, None, ex)
                return response
            return await self._relay_buffered(upstream, decode, None, None, ex)
        finally:
            decode.active -= 1
            if upstream is not None:
                _close(upstream)

    # -- one exchange with one pair ------------------------------------------------------

    async def _exchange(
        self,
        request: web.Request,
        data: bytes,
        prefill: Worker,
        decode: Worker,
        ex: Exchange,
        wants_logprobs: bool,
    ) -> web.StreamResponse:
        headers = forward_headers(request.headers, ex.rid)
        # The router reads the prefill answer (and, to merge logprobs, the decode answer):
        # uncompressed, so that it can.
        prefill_headers = CIMultiDict(headers)
        prefill_headers.popall("Accept-Encoding", None)
        if wants_logprobs:
            headers.popall("Accept-Encoding", None)
        prefill.active += 1  # given back by the prefill task, which may outlive this call
        prefill.num_requests += 1
        prefill_task = _task(self._prefill(prefill, request, data, prefill_headers, ex))
        decode.active += 1
        decode.num_requests += 1
        decode_task = _task(self._open_decode(decode, request, data, headers, ex))
        upstream: aiohttp.ClientResponse | None = None
        is_answered = False
        try:
            upstream = await _decode_first(decode_task, prefill_task)
            merger = None
            if wants_logprobs:
                merger = pd_body.StreamMerger(pd_body.input_logprobs(await prefill_task))
            if is_streamed(upstream):
                response, is_answered = await self._relay_stream(
                    request, upstream, decode, prefill_task, merger, ex
                )
            else:
                response = await self._relay_buffered(upstream, decode, prefill_task, merger, ex)
                is_answered = True
            return response
        finally:
            decode.active -= 1
            if not decode_task.done():
                decode_task.cancel()
            elif upstream is None and _succeeded(decode_task):
                upstream = decode_task.result()
            if upstream is not None:
                _close(upstream)
            if not prefill_task.done():
                if is_answered:
                    self._detached.add(prefill_task)
                    prefill_task.add_done_callback(self._detached.discard)
                else:
                    prefill_task.cancel()

    async def _prefill(
        self,
        worker: Worker,
        request: web.Request,
        data: bytes,
        headers: CIMultiDict[str],
        ex: Exchange,
    ) -> bytes:
        """The prefill side's whole answer, or _SideFailed. Gives back the worker's count."""
        upstream: aiohttp.ClientResponse | None = None
        try:
            upstream = await self._send(worker, PREFILL, request, data, headers, ex)
            try:
                answer = await upstream.read()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise self._failure(worker, PREFILL, exc, ex) from None
            if upstream.status >= 400:
                raise self._bad_status(worker, PREFILL, upstream, answer, ex)
            return answer
        finally:
            worker.active -= 1
            if upstream is not None:
                _close(upstream)

    async def _open_decode(
        self,
        worker: Worker,
        request: web.Request,
        data: bytes,
        headers: CIMultiDict[str],
        ex: Exchange,
    ) -> aiohttp.ClientResponse:
        """The decode side's answer with its headers in (the body is relayed by the caller),
        or _SideFailed for an answer the client must not get as it is."""
        upstream = await self._send(worker, DECODE, request, data, headers, ex)
        if upstream.status < 400:
            return upstream
        try:
            answer = await upstream.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise self._failure(worker, DECODE, exc, ex) from None
        finally:
            _close(upstream)
        raise self._bad_status(worker, DECODE, upstream, answer, ex)

    async def _send(
        self,
        worker: Worker,
        role: str,
        request: web.Request,
        data: bytes,
        headers: CIMultiDict[str],
        ex: Exchange,
    ) -> aiohttp.ClientResponse:
        self.metrics.observe_pd_request(role, worker.url)
        try:
            upstream = await self.session.request(
                request.method,
                URL(worker.url + request.raw_path, encoded=True),
                data=data,
                headers=headers,
                timeout=self._timeout,
                allow_redirects=False,
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise self._failure(worker, role, exc, ex) from None
        status = upstream.status
        self.registry.record_request(
            worker, status, is_request_fault=is_request_fault(status, upstream.headers)
        )
        return upstream

    def _failure(self, worker: Worker, role: str, exc: BaseException, ex: Exchange) -> _SideFailed:
        """A side that did not answer: timed out (504, final) or broke (502, retryable)."""
        self.metrics.observe_pd_failure(role, worker.url)
        if isinstance(exc, TimeoutError):
            self.registry.record_request(worker, None, "timed out")
            message = (
                f"{role} worker {worker.url} did not answer within "
                f"{self.config.request_timeout_secs}s (--request-timeout-secs)"
            )
            return _SideFailed(self._error(504, message, worker, role, ex), message, False)
        self.registry.record_request(worker, None, repr(exc))
        message = f"{role} worker {worker.url} failed: {exc!r}"
        return _SideFailed(self._error(502, message, worker, role, ex), message, True)

    def _bad_status(
        self,
        worker: Worker,
        role: str,
        upstream: aiohttp.ClientResponse,
        answer: bytes,
        ex: Exchange,
    ) -> _SideFailed:
        """A 4xx (or a 5xx blamed on the request) is relayed as it is; another answer of
        408/429/5xx is the side's failure, retried elsewhere while retries are left (then
        a 429/408 is relayed as it is, a 5xx becomes the router's 502 naming the side)."""
        status = upstream.status
        is_fault = is_request_fault(status, upstream.headers)
        relayed = web.Response(
            status=status,
            reason=upstream.reason,
            body=answer,
            headers=self._headers(upstream, worker, ex),
        )
        message = f"{role} worker {worker.url} answered {status}"
        if is_fault or status not in RETRY_STATUSES:
            return _SideFailed(relayed, message, False)
        self.metrics.observe_pd_failure(role, worker.url)
        if status < 500:
            return _SideFailed(relayed, message, True)
        text = answer[:_ERROR_SNIPPET].decode("utf-8", "replace")
        message += f": {text}"
        return _SideFailed(self._error(502, message, worker, role, ex), message, True)

    def _error(self, status: int, message: str, worker: Worker, role: str, ex: Exchange):
        kind = "gateway_timeout" if status == 504 else "bad_gateway"
        return error_response(status, message, ex.rid, kind, worker=worker.url, role=role)

    def _headers(
        self, upstream: aiohttp.ClientResponse, worker: Worker, ex: Exchange
    ) -> CIMultiDict[str]:
        headers = relay_headers(upstream, ex.rid, worker)
        if ex.prefill_worker is not None:
            headers[PREFILL_WORKER_HEADER] = ex.prefill_worker.url
        return headers

    # -- relaying the decode answer ------------------------------------------------------

    async def _relay_buffered(
        self,
        upstream: aiohttp.ClientResponse,
        decode: Worker,
        prefill_task: asyncio.Task | None,
        merger: pd_body.StreamMerger | None,
        ex: Exchange,
    ) -> web.Response:
        """A short answer with a length: read whole (unless the prefill side fails first)."""
        try:
            answer = await _unless_prefill_fails(upstream.read(), prefill_task)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise self._failure(decode, DECODE, exc, ex) from None
        if merger is not None:
            answer = pd_body.merge_answer(answer, merger.prefill_lps) or answer
        return web.Response(
            status=upstream.status,
            reason=upstream.reason,
            body=answer,
            headers=self._headers(upstream, decode, ex),
        )

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        decode: Worker,
        prefill_task: asyncio.Task | None,
        merger: pd_body.StreamMerger | None,
        ex: Exchange,
    ) -> tuple[web.StreamResponse, bool]:
        """Relay as chunks arrive (through `merger` when logprobs are merged); the response
        and whether it was relayed to its end. Past `prepare` a failure of either side
        ends the stream with an error event."""
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=self._headers(upstream, decode, ex),
        )
        if upstream.content_length is not None and merger is None:
            response.content_length = upstream.content_length
        try:
            await response.prepare(request)
        except ConnectionResetError:
            ex.is_client_gone = True
            return response, False
        while True:
            try:
                chunk = await _unless_prefill_fails(upstream.content.readany(), prefill_task)
            except _SideFailed as exc:
                await _end_stream(request, response, exc.message)
                return response, False
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                failed = self._failure(decode, DECODE, exc, ex)
                await _end_stream(request, response, f"stream broke: {failed.message}")
                return response, False
            if not chunk:
                break
            if merger is not None:
                chunk = merger.feed(chunk)
            if chunk and not await _write(response, chunk, ex):
                return response, False
        tail = merger.flush() if merger is not None else b""
        if tail and not await _write(response, tail, ex):
            return response, False
        await response.write_eof()
        return response, True


async def _decode_first(decode_task: asyncio.Task, prefill_task: asyncio.Task):
    """The decode side's answer once its headers are in; a prefill failure while it is still
    pending ends the wait (the prefill failure is the cause, even when both failed)."""
    while not decode_task.done():
        waiting = {decode_task} if prefill_task.done() else {decode_task, prefill_task}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not _succeeded(decode_task):
            _raise_if_failed(prefill_task)
    return decode_task.result()


async def _unless_prefill_fails(work, prefill_task: asyncio.Task | None):
    """Await `work` (a coroutine); if the prefill side (None: none) fails first, cancel it
    and raise."""
    if prefill_task is None or prefill_task.done():
        return await work
    future = _task(work)
    try:
        await asyncio.wait({future, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
        if not future.done():
            _raise_if_failed(prefill_task)
        return await future
    finally:
        if not future.done():
            future.cancel()


def _raise_if_failed(task: asyncio.Task) -> None:
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


def _succeeded(task: asyncio.Task) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


def _task(coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    # A side's failure may never be awaited (the exchange already ended): mark it seen.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _close(upstream: aiohttp.ClientResponse) -> None:
    if upstream.content.is_eof():
        upstream.release()  # fully read: the connection goes back to the pool
    else:
        upstream.close()  # cut short: the worker sees its connection closed


async def _write(response: web.StreamResponse, chunk: bytes, ex: Exchange) -> bool:
    try:
        await response.write(chunk)
    except ConnectionResetError:
        ex.is_client_gone = True
        return False
    return True


_error_encoder = msgspec.json.Encoder()


async def _end_stream(request: web.Request, response: web.StreamResponse, message: str) -> None:
    """End a begun stream badly: an error event the client can read, then a cut connection
    (no `[DONE]`, no clean end), so that the truncation shows."""
    error = {"error": {"message": message, "type": "bad_gateway", "code": 502}}
    if response.content_type == "text/event-stream":
        with contextlib.suppress(ConnectionResetError):
            await response.write(b"data: " + _error_encoder.encode(error) + b"\n\n")
    if request.transport is not None:
        request.transport.close()
