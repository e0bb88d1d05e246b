"""A stand-in for the Kubernetes API server's pod list and watch, on a real loopback socket.

`FakeKubeApi` serves GET /api/v1/namespaces/{ns}/pods and GET /api/v1/pods in the API
server's JSON shapes: a PodList with metadata.resourceVersion, or with watch=1/true a
stream of newline-delimited {"type": ..., "object": Pod} events from the resourceVersion
asked for. It honours labelSelector (equality, inequality and existence terms), the
namespace in the path, resourceVersion and timeoutSeconds, and sends what the real server
sends when a pod stops matching a watch's selector (DELETED) or when the version asked
for is older than the history it keeps (an ERROR event with a 410 Status).

Tests change pods with `put_pod`/`set_ready`/`delete_pod`; `notify=False` changes a pod
without any watch event (as if the events were lost to compaction), and `expire()` ends
every open watch with a 410, as the API server does when its history moved on.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Change:
    version: int
    type: str  # ADDED, MODIFIED or DELETED
    pod: dict  # the pod after the change (for DELETED, as it was last)
    before: dict | None  # the pod before the change


@dataclass
class FakeKubeApi:
    pods: dict[tuple[str, str], dict] = field(default_factory=dict)
    version: int = 100
    history: list[Change] = field(default_factory=list)
    oldest_version: int = 100  # a watch from before this gets 410 Gone
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    list_status: int = 200  # answer lists with this status (403: missing RBAC)
    watch_limit_secs: float | None = None  # end watches sooner than their timeoutSeconds
    url: str = ""
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _epoch: int = 0  # bumped by expire(): open watches of older epochs end with a 410
    _runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> FakeKubeApi:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            self._epoch += 1
            await self._wake()
            await self._runner.cleanup()
            self._runner = None

    # -- what tests call -------------------------------------------------------------------

    @property
    def lists(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if q.get("watch") not in ("1", "true")]

    @property
    def watches(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if q.get("watch") in ("1", "true")]

    async def put_pod(
        self,
        name: str,
        ip: str | None = "127.0.0.1",
        *,
        namespace: str = "default",
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        phase: str = "Running",
        ready: bool = True,
        terminating: bool = False,
        notify: bool = True,
    ) -> dict:
        """Create or replace a pod in the state given."""
        meta = {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "labels": dict(labels if labels is not None else {"app": "cadence"}),
            "annotations": dict(annotations or {}),
            "creationTimestamp": "2026-01-01T00:00:00Z",
        }
        if terminating:
            meta["deletionTimestamp"] = "2026-01-01T00:10:00Z"
            meta["deletionGracePeriodSeconds"] = 30
        status: dict = {
            "phase": phase,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
                {"type": "ContainersReady", "status": "True" if ready else "False"},
            ],
        }
        if ip is not None:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": meta,
            "spec": {"containers": [{"name": "cadence", "image": "cadence:latest"}]},
            "status": status,
        }
        await self._change((namespace, name), pod, notify)
        return pod

    async def set_ready(self, name: str, ready: bool, namespace: str = "default") -> None:
        pod = copy.deepcopy(self.pods[(namespace, name)])
        for condition in pod["status"]["conditions"]:
            if condition["type"] in ("Ready", "ContainersReady"):
                condition["status"] = "True" if ready else "False"
        await self._change((namespace, name), pod, True)

    async def delete_pod(self, name: str, namespace: str = "default", notify: bool = True) -> None:
        await self._change((namespace, name), None, notify)

    async def expire(self) -> None:
        """Forget every change so far: watches open now, or resumed from an older version,
        get 410 Gone and must list again."""
        self.history.clear()
        self.oldest_version = self.version + 1
        self._epoch += 1
        await self._wake()

    # -- state -----------------------------------------------------------------------------

    async def _change(self, key: tuple[str, str], pod: dict | None, notify: bool) -> None:
        before = self.pods.get(key)
        self.version += 1
        if pod is None:
            if before is None:
                return
            del self.pods[key]
            gone = copy.deepcopy(before)
            gone["metadata"]["resourceVersion"] = str(self.version)
            change = Change(self.version, "DELETED", gone, before)
        else:
            pod["metadata"]["resourceVersion"] = str(self.version)
            self.pods[key] = pod
            change = Change(self.version, "MODIFIED" if before else "ADDED", pod, before)
        if notify:
            self.history.append(change)
        else:  # lost: nobody may resume from before it
            self.history.clear()
            self.oldest_version = self.version + 1
        await self._wake()

    async def _wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- HTTP ------------------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.path, query))
        namespace = request.match_info.get("namespace")
        try:
            selector = parse_selector(query.get("labelSelector", ""))
        except ValueError as exc:
            return _status(400, "BadRequest", str(exc))
        if query.get("watch") in ("1", "true"):
            return await self._watch(request, namespace, selector, query)
        if self.list_status != 200:
            return _status(self.list_status, "Forbidden", 'pods is forbidden: User "x" cannot list')
        items = [
            pod
            for (ns, _), pod in sorted(self.pods.items())
            if namespace in (None, ns) and selector_matches(selector, pod)
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": [
                    {k: v for k, v in p.items() if k not in ("kind", "apiVersion")} for p in items
                ],
            }
        )

    async def _watch(
        self, request: web.Request, namespace: str | None, selector, query: dict[str, str]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        start = query.get("resourceVersion") or ""
        position = int(start) if start not in ("", "0") else self.version
        epoch = self._epoch
        limit = float(query.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + min(limit, self.watch_limit_secs or limit)
        while True:
            if position + 1 < self.oldest_version or epoch != self._epoch:
                await _write(response, _expired(position, self.version))
                return response
            for change in [c for c in self.history if c.version > position]:
                kind = _event_type(change, namespace, selector)
                if kind is not None:  # a pod that stops matching is DELETED, in its new state
                    await _write(response, {"type": kind, "object": change.pod})
                position = change.version
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                await response.write_eof()  # the server's timeout: the client resumes
                return response
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=remaining)
                except TimeoutError:
                    pass


def parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    """'a=b,c!=d,e' -> [(a, '=', b), (c, '!=', d), (e, 'exists', None)]."""
    terms: list[tuple[str, str, str | None]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        for op in ("!=", "==", "="):
            if op in part:
                key, value = part.split(op, 1)
                terms.append((key.strip(), "!=" if op == "!=" else "=", value.strip()))
                break
        else:
            if not part.replace("/", "").replace(".", "").replace("-", "").isalnum():
                raise ValueError(f"unable to parse requirement: {part!r}")
            terms.append((part, "exists", None))
    return terms


def selector_matches(terms, pod: dict | None) -> bool:
    if pod is None:
        return False
    labels = pod["metadata"].get("labels") or {}
    for key, op, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
    return True


def _event_type(change: Change, namespace: str | None, selector) -> str | None:
    """What a watch with this namespace and selector sees of a change, or None."""
    if namespace not in (None, change.pod["metadata"]["namespace"]):
        return None
    now = change.type != "DELETED" and selector_matches(selector, change.pod)
    was = selector_matches(selector, change.before)
    if now:
        return "MODIFIED" if was else "ADDED"
    return "DELETED" if was else None


def _expired(asked: int, current: int) -> dict:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {asked} ({current})",
            "reason": "Expired",
            "code": 410,
        },
    }


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.json_response(body, status=code)


async def _write(response: web.StreamResponse, event: dict) -> None:
    await response.write(json.dumps(event).encode() + b"\n")
