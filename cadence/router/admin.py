"""The router's own routes: liveness, readiness, workers management, models, metrics.

The worker management routes are the admin API (see `access.py` for who may call
them). Their bodies are small JSON documents: at most MAX_ADMIN_BODY_BYTES, refused
with 413 from the Content-Length, or once that many bytes of a chunked body have
arrived, so an oversized body is never read whole.
"""

from __future__ import annotations

import asyncio
import json
from typing import Protocol

import aiohttp
from aiohttp import web

from cadence.router.access import AccessControl, Handler, admin_only
from cadence.router.config import (
    DECODE,
    PREFILL,
    RouterConfig,
    WorkerSpec,
    check_role,
    short_repr,
    worker_spec_from_dict,
)
from cadence.router.metrics import CONTENT_TYPE, RouterMetrics
from cadence.router.proxy import error_response, payload_too_large, read_body, request_id
from cadence.router.workers import HealthState, Worker, WorkerRegistry


class Router(Protocol):
    """What the admin routes need of the router (cadence.router.server.Router)."""

    config: RouterConfig
    access: AccessControl
    registry: WorkerRegistry
    metrics: RouterMetrics
    session: aiohttp.ClientSession | None

    def add_worker(self, spec: WorkerSpec) -> Worker: ...

    def update_worker(self, worker: Worker, changes: dict) -> None: ...

    async def remove_worker(self, worker: Worker) -> None: ...


MAX_ADMIN_BODY_BYTES = 64 * 1024


def add_routes(app: web.Application, router: Router) -> None:
    handlers = _AdminHandlers(router)
    app.router.add_get("/live", handlers.live)
    app.router.add_get("/ready", handlers.ready)
    app.router.add_get("/health", handlers.health)

    def admin(handler: Handler) -> Handler:
        return admin_only(router.access, _capped(handler))

    app.router.add_get("/workers", admin(handlers.list_workers))
    app.router.add_post("/workers", admin(handlers.add_worker))
    # `.+`: the id may be the worker URL itself, slashes and all (/workers/http://host:port).
    worker_path = "/workers/{worker_id:.+}"
    app.router.add_get(worker_path, admin(handlers.get_worker))
    app.router.add_put(worker_path, admin(handlers.update_worker))
    app.router.add_delete(worker_path, admin(handlers.delete_worker))
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/metrics", handlers.metrics)


class _AdminHandlers:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.registry = router.registry

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _readiness(self) -> tuple[bool, dict]:
        """Whether requests can be routed: a routable worker, or in PD mode a routable
        prefill and a routable decode worker; with the counts that say so."""
        num_routable = len(self.registry.routable)
        if not self.router.config.pd_disaggregation:
            return num_routable > 0, {"num_routable_workers": num_routable}
        by_role = {r: sum(w.role == r for w in self.registry.routable) for r in (PREFILL, DECODE)}
        facts = {"num_routable_workers": num_routable, "num_routable_by_role": by_role}
        return all(by_role.values()), facts

    async def ready(self, request: web.Request) -> web.Response:
        is_ready, facts = self._readiness()
        return web.json_response({"ready": is_ready, **facts}, status=200 if is_ready else 503)

    async def health(self, request: web.Request) -> web.Response:
        """200 while requests can be routed, with a count of workers by state."""
        counts = {state.value: 0 for state in HealthState}
        for worker in self.registry:
            counts[worker.health.value] += 1
        is_ready, facts = self._readiness()
        config = self.router.config
        if is_ready:
            status = "ok"
        elif config.pd_disaggregation and facts["num_routable_workers"]:
            status = "PD mode needs a routable prefill and a routable decode worker"
        else:
            status = "no routable worker"
        body = {"status": status, **facts, "workers_by_health": counts, "policy": config.policy}
        if config.pd_disaggregation:
            body["prefill_policy"] = config.policy_for(PREFILL)
            body["decode_policy"] = config.policy_for(DECODE)
        return web.json_response(body, status=200 if is_ready else 503)

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": [w.to_dict() for w in self.registry]})

    async def get_worker(self, request: web.Request) -> web.Response:
        worker = self._find(request)
        if worker is None:
            return _not_found(request)
        return web.json_response(worker.to_dict())

    async def add_worker(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            spec = worker_spec_from_dict(body, field="worker")
            check_role(spec, self.router.config.pd_disaggregation)
        except ValueError as exc:
            return _bad_request(request, str(exc))
        try:
            worker = self.router.add_worker(spec)
        except KeyError:
            return _error(request, 409, f"worker {spec.url} already exists", "conflict")
        return web.json_response(worker.to_dict(), status=201)

    async def update_worker(self, request: web.Request) -> web.Response:
        worker = self._find(request)
        if worker is None:
            return _not_found(request)
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body, dict) or not body:
            return _bad_request(request, "body must be a non-empty JSON object")
        try:
            self.router.update_worker(worker, body)
        except ValueError as exc:
            return _bad_request(request, str(exc))
        return web.json_response(worker.to_dict())

    async def delete_worker(self, request: web.Request) -> web.Response:
        worker = self._find(request)
        if worker is None:
            return _not_found(request)
        await self.router.remove_worker(worker)
        return web.json_response({"removed": worker.id})

    async def models(self, request: web.Request) -> web.Response:
        """Union of the routable workers' /v1/models, asked in parallel, deduplicated by id."""
        workers = self.registry.routable
        if not workers:
            return _error(
                request, 503, "no healthy worker to list models from", "no_worker_available"
            )
        answers = await asyncio.gather(*(self._worker_models(w, request) for w in workers))
        merged: dict[str, dict] = {}
        failures = []
        for worker, (models, error) in zip(workers, answers):
            if error is not None:
                failures.append({"worker": worker.url, "error": error})
            for model in models:
                merged.setdefault(model["id"], model)
        if len(failures) == len(workers):
            return _error(
                request,
                502,
                "every worker failed to list its models",
                "bad_gateway",
                workers=failures,
            )
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.router.metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE
        return response

    async def _worker_models(
        self, worker: Worker, request: web.Request
    ) -> tuple[list[dict], str | None]:
        headers = {}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        timeout = aiohttp.ClientTimeout(total=self.router.config.health_check_timeout_secs)
        assert self.router.session is not None
        try:
            async with self.router.session.get(
                worker.url + "/v1/models", headers=headers, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    return [], f"answered {resp.status}"
                body = json.loads(await resp.read())
        except TimeoutError:
            return [], "timed out"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return [], repr(exc)
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            return [], "answer has no 'data' list"
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)], None

    def _find(self, request: web.Request) -> Worker | None:
        """The worker named by its id or its URL (aiohttp has already percent-decoded the path)."""
        return self.registry.get(request.match_info["worker_id"])


def _capped(handler: Handler) -> Handler:
    """Refuse an admin request whose declared body is over the cap before anything else."""

    async def capped(request: web.Request) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > MAX_ADMIN_BODY_BYTES:
            return _too_large(request)
        return await handler(request)

    return capped


async def _json_body(request: web.Request) -> object:
    """The parsed JSON body, or the 413/400 response explaining what is wrong with it."""
    data = await read_body(request, MAX_ADMIN_BODY_BYTES)
    if data is None:
        return _too_large(request)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _bad_request(request, f"body is not UTF-8 text: invalid byte at offset {exc.start}")
    try:
        return json.loads(text)
    except RecursionError:
        return _bad_request(request, "body is not usable JSON: nested too deeply")
    except ValueError as exc:
        return _bad_request(request, f"body is not valid JSON: {exc}")


def _too_large(request: web.Request) -> web.Response:
    return payload_too_large(
        f"admin request body is larger than {MAX_ADMIN_BODY_BYTES} bytes", request_id(request)
    )


def _error(request: web.Request, status: int, message: str, kind: str, **extra) -> web.Response:
    return error_response(status, message, request_id(request), kind, **extra)


def _bad_request(request: web.Request, message: str) -> web.Response:
    return _error(request, 400, message, "invalid_request")


def _not_found(request: web.Request) -> web.Response:
    return _error(
        request,
        404,
        f"no worker {short_repr(request.match_info['worker_id'])}; GET /workers lists them",
        "not_found",
    )
