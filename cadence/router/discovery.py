"""Kubernetes service discovery: the router's workers follow the ready pods its labels choose.

One task per role (regular; or prefill and decode in PD mode) lists the pods its label
selector chooses, then watches them from the list's resourceVersion, resuming from the
last version seen each time the API server ends a watch. When the API server answers 410
Gone (the version is older than the history it keeps) the task lists again and
reconciles: pods that went away in between are removed, new ones added. Any other
failure (API server unreachable, 403 for missing RBAC) is logged and retried with backoff;
the router keeps serving the workers it has.

A pod becomes a worker, http://POD_IP:PORT, through the same path as the admin API's
POST /workers: it starts `unknown` and is probed at once, and becomes routable only once
its probes succeed. A pod that stops being ready, starts terminating or is deleted is
removed like DELETE /workers/{id} (requests in progress finish). Discovery only ever
removes workers it added itself: workers from --worker-urls, --worker-config or the admin
API stay, even when a pod has the same address.

The Kubernetes client is imported only here, and only when discovery starts: a router
without --service-discovery never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Protocol

import aiohttp

from cadence.router.config import RouterConfig, WorkerSpec, short_repr
from cadence.router.pods import Selector, pod_key, selector_string, wanted_worker
from cadence.router.workers import Worker, WorkerRegistry

logger = logging.getLogger("cadence.router")

# The API server ends each watch after this long; the next one resumes where it stopped.
WATCH_TIMEOUT_SECS = 300
# A watch's client-side limit: the server's timeout plus room for a slow last event.
WATCH_REQUEST_SECS = WATCH_TIMEOUT_SECS + 30
LIST_REQUEST_SECS = 60
RETRY_INITIAL_SECS = 0.5
RETRY_MAX_SECS = 30.0


class DiscoveryError(Exception):
    """The API server answered something other than pods."""


# Failures that say what they are in one line (anything else is logged with its type).
_EXPECTED_FAILURES = (DiscoveryError, aiohttp.ClientError, OSError, TimeoutError, ValueError)


class Target(Protocol):
    """What discovery needs of the router (cadence.router.server.Router)."""

    registry: WorkerRegistry

    def add_worker(self, spec: WorkerSpec) -> Worker: ...

    async def remove_worker(self, worker: Worker) -> None: ...


class PodDiscovery:
    """Keeps the workers it added equal to the ready pods its selectors choose."""

    def __init__(self, config: RouterConfig, target: Target) -> None:
        self.config = config
        self.target = target
        self.selectors: dict[str, Selector] = config.selectors()
        self.port = config.service_discovery_port
        self.namespace = config.service_discovery_namespace
        # The workers discovery added, by the pod (namespace/name) each one is.
        self.owned: dict[str, WorkerSpec] = {}
        # kubernetes.aio's ApiClient and CoreV1Api, made in start() (the import happens there).
        self._api_client: Any = None
        self._core: Any = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Connect to the API server (ValueError when there is no way to) and start watching."""
        self._api_client = await open_api_client(self.config)
        from kubernetes.aio.client import CoreV1Api

        self._core = CoreV1Api(self._api_client)
        where = f"namespace {self.namespace}" if self.namespace else "all namespaces"
        for role, pairs in self.selectors.items():
            logger.info(
                "service discovery: %s workers are ready pods labelled %s in %s, port %d",
                role,
                selector_string(pairs),
                where,
                self.port,
            )
            self._tasks.append(asyncio.create_task(self._run(role), name=f"discovery {role}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    # -- list and watch ------------------------------------------------------------------

    async def _run(self, role: str) -> None:
        delay = RETRY_INITIAL_SECS
        while True:
            try:
                version: str | None = await self._list(role)
                while version is not None:
                    version = await self._watch(role, version)
                    delay = RETRY_INITIAL_SECS  # a watch that ran to its end: all is well
                logger.info("service discovery (%s): the watch expired; listing pods again", role)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # whatever it was, the router keeps serving; retry
                expected = isinstance(exc, _EXPECTED_FAILURES)
                logger.warning(
                    "service discovery (%s): %s; retrying in %.1fs",
                    role,
                    exc if expected else repr(exc),
                    delay,
                    exc_info=not expected and logger.isEnabledFor(logging.DEBUG),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECS)

    async def _list(self, role: str) -> str:
        """List the role's pods, bring the workers in line with them; the list's version."""
        response = await self._request(role, _request_timeout=LIST_REQUEST_SECS)
        try:
            if response.status != 200:
                raise DiscoveryError(await _failure(response, "listing pods"))
            body = await response.json(content_type=None)
        finally:
            response.release()
        items = body.get("items") if isinstance(body, dict) else None
        meta = body.get("metadata") if isinstance(body, dict) else None
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if not isinstance(items, list) or not isinstance(version, str):
            raise DiscoveryError(f"the pod list is not a PodList: {short_repr(body)}")
        listed = set()
        for pod in items:
            if isinstance(pod, dict):
                listed.add(pod_key(pod))
                await self._apply(role, pod)
        for key, spec in list(self.owned.items()):
            if spec.role == role and key not in listed:
                await self._drop(key, "is gone")
        return version

    async def _watch(self, role: str, version: str) -> str | None:
        """Apply the role's pod events from `version` on until the API server ends the watch.

        Returns the last version seen (watch again from there), or None when that version
        has expired (410 Gone: list again)."""
        response = await self._request(
            role,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_SECS,
            _request_timeout=WATCH_REQUEST_SECS,
        )
        try:
            if response.status == 410:
                return None
            if response.status != 200:
                raise DiscoveryError(await _failure(response, "watching pods"))
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") if isinstance(event, dict) else None
                if not isinstance(obj, dict):
                    raise DiscoveryError(f"malformed watch event {short_repr(event)}")
                kind = event.get("type")
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return None
                    raise DiscoveryError(
                        f"the pod watch failed: {obj.get('code')} {short_repr(obj.get('message'))}"
                    )
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    await self._apply(role, obj, is_deleted=kind == "DELETED")
        finally:
            response.close()  # a watch cut short must not go back to the pool half read
        return version

    async def _request(self, role: str, **params) -> aiohttp.ClientResponse:
        """GET the role's pods (a list, or with watch=True a stream of events)."""
        assert self._core is not None, "discovery not started"
        selector = selector_string(self.selectors[role])
        if self.namespace:
            return await self._core.list_namespaced_pod_without_preload_content(
                self.namespace, label_selector=selector, **params
            )
        return await self._core.list_pod_for_all_namespaces_without_preload_content(
            label_selector=selector, **params
        )

    # -- pods to workers -----------------------------------------------------------------

    async def _apply(self, role: str, pod: dict, is_deleted: bool = False) -> None:
        """Make the pod's worker (for this role's watch) what the pod is now."""
        key = pod_key(pod)
        spec = None
        if not is_deleted:
            try:
                spec = wanted_worker(pod, role, self.selectors, self.port)
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("service discovery: pod %s makes no worker: %s", key, exc)
        owned = self.owned.get(key)
        if owned is not None and owned.role != role and spec is None:
            return  # the pod is the other role's; its own watch keeps it
        if owned is not None and owned != spec:
            why = "was deleted" if is_deleted else "is not ready" if spec is None else "changed"
            await self._drop(key, why)
        if spec is not None and key not in self.owned:
            self._add(key, spec)

    def _add(self, key: str, spec: WorkerSpec) -> None:
        if self.target.registry.get(spec.url) is not None:
            # A configured worker (or another pod's, at the same address): never ours to drop.
            logger.info(
                "service discovery: pod %s is %s, already a worker; left as it is", key, spec.url
            )
            return
        self.target.add_worker(spec)
        self.owned[key] = spec
        logger.info(
            "service discovery: pod %s is ready: added %s worker %s", key, spec.role, spec.url
        )

    async def _drop(self, key: str, why: str) -> None:
        spec = self.owned.pop(key, None)
        if spec is None:
            return
        worker = self.target.registry.get(spec.url)
        if worker is not None:
            await self.target.remove_worker(worker)
        logger.info("service discovery: pod %s %s: removed worker %s", key, why, spec.url)


async def open_api_client(config: RouterConfig):
    """A Kubernetes API client: --service-discovery-api-server as given (no credentials),
    else the pod's service account (in a cluster), else the kubeconfig ($KUBECONFIG or
    ~/.kube/config). ValueError when none of them is there."""
    from kubernetes.aio import client
    from kubernetes.aio import config as kube_config

    configuration = client.Configuration()
    if config.service_discovery_api_server is not None:
        configuration.host = config.service_discovery_api_server.rstrip("/")
        return client.ApiClient(configuration)
    try:
        kube_config.load_incluster_config(client_configuration=configuration)
    except kube_config.ConfigException as not_in_cluster:
        try:
            await kube_config.load_kube_config(
                client_configuration=configuration, persist_config=False
            )
        except (kube_config.ConfigException, OSError) as exc:
            raise ValueError(
                "service_discovery: no Kubernetes API to watch: not in a pod "
                f"({not_in_cluster}) and no usable kubeconfig ({exc}); run the router in the "
                "cluster, set KUBECONFIG, or give --service-discovery-api-server URL"
            ) from None
    return client.ApiClient(configuration)


async def _failure(response: aiohttp.ClientResponse, doing: str) -> str:
    """What went wrong, from the API server's Status answer."""
    try:
        body = json.loads(await response.read())
        message = body.get("message") if isinstance(body, dict) else None
    except (ValueError, OSError):
        message = None
    text = f"{doing} answered {response.status}: {short_repr(message or response.reason)}"
    if response.status in (401, 403):
        text += (
            " (the router's service account needs get, list and watch on pods: see the Role "
            "in deploy/kubernetes/router.yaml)"
        )
    return text
