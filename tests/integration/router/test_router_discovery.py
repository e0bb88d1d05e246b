"""Kubernetes service discovery: a real router watching a stand-in API server.

The API server (kube_fakes.FakeKubeApi) and the workers are real HTTP servers on loopback
sockets. The pods' IPs are loopback addresses (127.0.0.2, 127.0.0.3, ...) where fake
workers listen on one port, as the pods of one Deployment do, so a discovered worker is
probed for real and requests are routed to it.

Where a test asserts that a pod did NOT become a worker, it then changes a marker pod and
waits for that: the router applies a watch's events in order, so once the marker is in,
the change before it has been seen.
"""

from __future__ import annotations

import logging

import pytest
from kube_fakes import FakeKubeApi
from router_fakes import FakeWorker, closed_port_url, wait_for

from cadence.router.config import RouterConfig, load_worker_specs
from cadence.router.server import Router

FAST = {
    "health_check_interval_secs": 0.05,
    "health_check_startup_interval_secs": 0.02,
    "health_check_timeout_secs": 1.0,
    "health_success_threshold": 1,
}
MARKER_IP = "127.0.0.99"  # a marker pod's address: it joins the registry, nothing answers there


@pytest.fixture
async def kube_api():
    api = await FakeKubeApi().start()
    yield api
    await api.stop()


@pytest.fixture
async def pod_workers(make_worker):
    """`make(n)`: n fake workers on 127.0.0.2, 127.0.0.3, ..., all on one port."""

    async def make(n: int) -> list[FakeWorker]:
        first = await make_worker(host="127.0.0.2", body=b'{"from": "127.0.0.2"}')
        rest = [
            await make_worker(host=f"127.0.0.{i}", port=first.port, body=b'{"from": "%d"}' % i)
            for i in range(3, n + 2)
        ]
        return [first, *rest]

    return make


@pytest.fixture
async def make_router(kube_api):
    """`make(port, static=(), **overrides)`: a started router discovering pods of kube_api,
    returned once its first list is done and its watch is open."""
    routers: list[Router] = []

    async def make(port: int, static: tuple[str, ...] = (), **overrides) -> Router:
        fields = {
            "port": 0,
            "service_discovery": True,
            "selector": ("app=cadence",),
            "service_discovery_port": port,
            "service_discovery_api_server": kube_api.url,
            "enable_admin_api": True,
            "worker_urls": static,
            **FAST,
            **overrides,
        }
        config = RouterConfig(**fields)
        num_watches = len(kube_api.watches) + len(config.selectors())
        router = Router(config, load_worker_specs(config))
        await router.start()
        routers.append(router)
        await wait_for(lambda: len(kube_api.watches) >= num_watches, what="the pod watch")
        return router

    yield make
    for router in routers:
        await router.stop()


def free_port() -> int:
    """A port for pods nothing answers on (their workers stay unknown, which these tests
    do not mind)."""
    return int(closed_port_url().rsplit(":", 1)[1])


def urls(router: Router) -> set[str]:
    return {w.url for w in router.registry}


def routable(router: Router) -> set[str]:
    return {w.url for w in router.registry.routable}


async def add_marker(api: FakeKubeApi, router: Router, port: int, **pod) -> None:
    """Put a ready marker pod and wait until the router has it: every earlier event is in."""
    await api.put_pod("marker", MARKER_IP, **pod)
    await wait_for(lambda: f"http://{MARKER_IP}:{port}" in urls(router), what="the marker pod")


async def test_a_pod_becomes_a_worker_once_ready_and_requests_reach_it(
    kube_api, pod_workers, make_router, client
):
    (worker,) = await pod_workers(1)
    router = await make_router(worker.port)
    await kube_api.put_pod("w0", None, phase="Pending", ready=False)  # scheduled, no IP yet
    await kube_api.put_pod("w0", "127.0.0.2", ready=False)  # running, not ready
    await add_marker(kube_api, router, worker.port)
    assert worker.url not in urls(router)

    await kube_api.set_ready("w0", True)
    await wait_for(lambda: worker.url in routable(router), what="the ready pod routable")
    async with client.get(router.url + "/workers") as resp:
        listed = {w["url"]: w for w in (await resp.json())["workers"]}
    assert listed[worker.url]["health"] == "healthy"
    assert listed[worker.url]["role"] == "regular"

    await kube_api.delete_pod("marker")  # leave the real pod as the only worker
    await wait_for(lambda: urls(router) == {worker.url}, what="the marker gone")
    async with client.post(router.url + "/generate", json={"text": "hi"}) as resp:
        assert resp.status == 200
        assert resp.headers["x-cadence-worker"] == worker.url
        assert await resp.read() == b'{"from": "127.0.0.2"}'
    assert worker.num_requests == 1


async def test_a_pod_that_stops_being_ready_terminates_or_is_deleted_is_removed(
    kube_api, pod_workers, make_router, client
):
    w0, w1 = await pod_workers(2)
    router = await make_router(w0.port)
    await kube_api.put_pod("w0", "127.0.0.2")
    await kube_api.put_pod("w1", "127.0.0.3")
    await wait_for(lambda: routable(router) == {w0.url, w1.url}, what="both pods routable")

    await kube_api.set_ready("w0", False)
    await wait_for(lambda: urls(router) == {w1.url}, what="the unready pod removed")
    await kube_api.set_ready("w0", True)
    await wait_for(lambda: routable(router) == {w0.url, w1.url}, what="the pod back")

    # Terminating: still Running and Ready while it drains, but it gets no new requests.
    await kube_api.put_pod("w0", "127.0.0.2", terminating=True)
    await wait_for(lambda: urls(router) == {w1.url}, what="the terminating pod removed")
    async with client.post(router.url + "/generate", json={"text": "hi"}) as resp:
        assert resp.headers["x-cadence-worker"] == w1.url

    await kube_api.delete_pod("w1")
    await kube_api.delete_pod("w0")
    await wait_for(lambda: not urls(router), what="the deleted pods removed")
    async with client.get(router.url + "/ready") as resp:
        assert resp.status == 503


async def test_only_pods_of_the_namespace_given_are_workers(kube_api, make_router):
    port = free_port()
    await kube_api.put_pod("a", "127.0.0.2", namespace="team-a")
    await kube_api.put_pod("b", "127.0.0.3", namespace="team-b")
    in_a = await make_router(port, service_discovery_namespace="team-a")
    everywhere = await make_router(port)
    await wait_for(lambda: len(urls(everywhere)) == 2, what="pods of every namespace")
    assert urls(in_a) == {f"http://127.0.0.2:{port}"}

    await kube_api.put_pod("c", "127.0.0.4", namespace="team-b")
    await kube_api.put_pod("d", "127.0.0.5", namespace="team-a")
    await wait_for(lambda: len(urls(in_a)) == 2, what="the new pod of team-a")
    await wait_for(lambda: len(urls(everywhere)) == 4, what="all four pods")
    assert urls(in_a) == {f"http://127.0.0.2:{port}", f"http://127.0.0.5:{port}"}
    paths = {path for path, _ in kube_api.requests}
    assert paths == {"/api/v1/namespaces/team-a/pods", "/api/v1/pods"}


async def test_a_pod_must_carry_every_label_of_the_selector(kube_api, make_router):
    port = free_port()
    router = await make_router(port, selector=("app=cadence", "tier=gold"))
    both = {"app": "cadence", "tier": "gold"}
    await kube_api.put_pod("gold", "127.0.0.2", labels=both)
    await kube_api.put_pod("app-only", "127.0.0.3", labels={"app": "cadence"})
    await kube_api.put_pod("silver", "127.0.0.4", labels={"app": "cadence", "tier": "silver"})
    await kube_api.put_pod("other-app", "127.0.0.5", labels={"app": "other", "tier": "gold"})
    await add_marker(kube_api, router, port, labels=both)
    assert urls(router) == {f"http://127.0.0.2:{port}", f"http://{MARKER_IP}:{port}"}
    assert {q["labelSelector"] for _, q in kube_api.requests} == {"app=cadence,tier=gold"}

    # Relabelled out of the selector: the API server says DELETED; relabelled in: ADDED.
    await kube_api.put_pod("gold", "127.0.0.2", labels={"app": "cadence", "tier": "silver"})
    await kube_api.put_pod("app-only", "127.0.0.3", labels=both)
    await wait_for(
        lambda: urls(router) == {f"http://127.0.0.3:{port}", f"http://{MARKER_IP}:{port}"},
        what="the relabelled pods swapped",
    )


async def test_static_workers_are_never_removed_by_discovery(
    kube_api, pod_workers, make_router, make_worker
):
    w0, w1 = await pod_workers(2)
    static_elsewhere = await make_worker(host="127.0.0.7")
    # One static worker has the address a pod will have; the other is no pod's.
    router = await make_router(w0.port, static=(w0.url, static_elsewhere.url))
    await kube_api.put_pod("w0", "127.0.0.2")
    await kube_api.put_pod("w1", "127.0.0.3")
    await wait_for(
        lambda: routable(router) == {w0.url, w1.url, static_elsewhere.url}, what="all routable"
    )
    static_w0 = router.registry.get(w0.url)
    assert router.discovery is not None and set(router.discovery.owned) == {"default/w1"}

    await kube_api.set_ready("w0", False)
    await kube_api.delete_pod("w1")
    await kube_api.delete_pod("w0")
    await wait_for(lambda: w1.url not in urls(router), what="the discovered worker removed")
    await kube_api.expire()  # a re-list finds no pod at all
    await wait_for(lambda: len(kube_api.lists) == 2, what="the second list")
    await add_marker(kube_api, router, w0.port)
    assert urls(router) == {w0.url, static_elsewhere.url, f"http://{MARKER_IP}:{w0.port}"}
    assert router.registry.get(w0.url) is static_w0  # the very same worker, never replaced


async def test_an_expired_watch_makes_the_router_list_again(kube_api, make_router, caplog):
    caplog.set_level(logging.INFO, logger="cadence.router")
    port = free_port()
    router = await make_router(port)
    await kube_api.put_pod("kept", "127.0.0.2")
    await kube_api.put_pod("lost", "127.0.0.3")
    await wait_for(lambda: len(urls(router)) == 2, what="two pods")
    kept = router.registry.get(f"http://127.0.0.2:{port}")
    assert len(kube_api.lists) == 1

    # Changes whose events are lost (compacted away): only a new list can show them.
    await kube_api.delete_pod("lost", notify=False)
    await kube_api.put_pod("new", "127.0.0.4", notify=False)
    await wait_for(
        lambda: urls(router) == {f"http://127.0.0.2:{port}", f"http://127.0.0.4:{port}"},
        what="the re-list's pods",
    )
    assert len(kube_api.lists) == 2
    listed_at = kube_api.version
    await wait_for(lambda: len(kube_api.watches) == 2, what="the second watch")
    assert kube_api.watches[-1]["resourceVersion"] == str(listed_at)

    await kube_api.expire()  # an open watch ends with 410: list again, change nothing
    await wait_for(lambda: len(kube_api.lists) == 3, what="the third list")
    await kube_api.put_pod("later", "127.0.0.5")
    await wait_for(lambda: len(urls(router)) == 3, what="a pod after the re-list")
    assert router.registry.get(f"http://127.0.0.2:{port}") is kept  # never removed and re-added
    # Expiry is routine: the router lists again at once, without a failure and its backoff.
    assert "the watch expired; listing pods again" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_watch_the_api_server_ends_resumes_from_the_last_version(kube_api, make_router):
    kube_api.watch_limit_secs = 0.2
    router = await make_router(free_port())
    await kube_api.put_pod("w0", "127.0.0.2")
    await wait_for(lambda: len(urls(router)) == 1, what="the pod")
    seen = kube_api.version
    await wait_for(lambda: len(kube_api.watches) >= 3, what="two resumed watches")
    resumed = kube_api.watches[-1]
    assert resumed["resourceVersion"] == str(seen)
    assert resumed["allowWatchBookmarks"] == "true"
    assert len(kube_api.lists) == 1  # resumed, never re-listed
    await kube_api.delete_pod("w0")
    await wait_for(lambda: not urls(router), what="the pod deleted across watches")


async def test_pd_mode_discovers_prefill_and_decode_pods_with_the_bootstrap_port(
    kube_api, pod_workers, make_router
):
    prefill, decode = await pod_workers(2)
    router = await make_router(
        prefill.port,
        pd_disaggregation=True,
        selector=(),
        prefill_selector=("app=cadence", "role=prefill"),
        decode_selector=("app=cadence,role=decode",),
    )
    await kube_api.put_pod(
        "p0",
        "127.0.0.2",
        labels={"app": "cadence", "role": "prefill"},
        annotations={"sglang.ai/bootstrap-port": "8998"},
    )
    await kube_api.put_pod("d0", "127.0.0.3", labels={"app": "cadence", "role": "decode"})
    await wait_for(
        lambda: routable(router) == {prefill.url, decode.url}, what="both sides routable"
    )
    by_url = {w.url: w for w in router.registry}
    assert by_url[prefill.url].role == "prefill"
    assert by_url[prefill.url].bootstrap_port == 8998
    assert by_url[decode.url].role == "decode"
    assert by_url[decode.url].bootstrap_port is None
    selectors = {q["labelSelector"] for _, q in kube_api.requests}
    assert selectors == {"app=cadence,role=prefill", "app=cadence,role=decode"}

    await kube_api.delete_pod("d0")
    await wait_for(lambda: urls(router) == {prefill.url}, what="the decode pod removed")


async def test_api_server_refusals_are_logged_and_retried(kube_api, make_worker, caplog):
    worker = await make_worker(host="127.0.0.2")
    kube_api.list_status = 403
    await kube_api.put_pod("w0", "127.0.0.2")
    config = RouterConfig(
        port=0,
        service_discovery=True,
        selector=("app=cadence",),
        service_discovery_port=worker.port,
        service_discovery_api_server=kube_api.url,
        **FAST,
    )
    router = Router(config, [])
    caplog.set_level(logging.WARNING, logger="cadence.router")
    await router.start()
    try:
        await wait_for(lambda: len(kube_api.lists) >= 2, what="a retried list")
        assert not urls(router)
        assert "get, list and watch on pods" in caplog.text
        kube_api.list_status = 200
        await wait_for(lambda: routable(router) == {worker.url}, what="the pod after the retry")
    finally:
        await router.stop()
