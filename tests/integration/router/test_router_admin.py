"""The router's own routes: readiness, worker management, /v1/models, /metrics, API key."""

from __future__ import annotations

import asyncio
from urllib.parse import quote

from router_fakes import assert_idle, closed_port_url, wait_for

from cadence.router.workers import HealthState

CHAT = "/v1/chat/completions"


async def test_live_ready_health_follow_routable_workers(make_worker, make_router, client):
    router = await make_router([], wait_healthy=False, enable_admin_api=True)
    async with client.get(router.url + "/live") as resp:
        assert resp.status == 200
    async with client.get(router.url + "/ready") as resp:
        assert resp.status == 503
    async with client.get(router.url + "/health") as resp:
        assert resp.status == 503
    worker = await make_worker()
    async with client.post(router.url + "/workers", json={"url": worker.url + "/"}) as resp:
        assert resp.status == 201
        body = await resp.json()
        assert body["url"] == worker.url and body["health"] == "unknown"
        assert body["id"] == quote(worker.url, safe="")
    await wait_for(lambda: len(router.registry.routable) == 1, what="added worker healthy")
    async with client.get(router.url + "/ready") as resp:
        assert resp.status == 200
    async with client.get(router.url + "/health") as resp:
        body = await resp.json()
        assert resp.status == 200 and body["workers_by_health"]["healthy"] == 1


async def test_workers_crud_by_id_and_validation(make_worker, make_router, client):
    worker = await make_worker()
    router = await make_router([worker.url], enable_admin_api=True)
    wid = router.registry.get(worker.url).id
    async with client.get(router.url + "/workers") as resp:
        assert [w["url"] for w in (await resp.json())["workers"]] == [worker.url]
    async with client.get(router.url + "/workers/" + wid) as resp:
        assert resp.status == 200 and (await resp.json())["routable"] is True
    async with client.post(router.url + "/workers", json={"url": worker.url}) as resp:
        assert resp.status == 409
    for bad in ({"url": "ftp://x"}, {"url": "http://169.254.169.254"}, {"url": "http://a", "gpu": 1},
                {"url": "http://a", "capabilities": ["telepathy"]}):  # fmt: skip
        async with client.post(router.url + "/workers", json=bad) as resp:
            assert resp.status == 400, bad
    async with client.post(router.url + "/workers", data=b"{not json") as resp:
        assert resp.status == 400
    async with client.put(router.url + "/workers/" + wid, json={"bogus": True}) as resp:
        assert resp.status == 400 and "bogus" in (await resp.json())["error"]["message"]
    async with client.put(
        router.url + "/workers/" + wid, json={"capabilities": ["embedding"]}
    ) as resp:
        assert (await resp.json())["capabilities"] == ["embedding"]
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 503  # it no longer does chat
    async with client.delete(router.url + "/workers/" + wid) as resp:
        assert resp.status == 200
    async with client.get(router.url + "/workers/" + wid) as resp:
        assert resp.status == 404
    assert len(router.registry) == 0


async def test_disable_takes_worker_out_while_probes_continue(make_worker, make_router, client):
    a, b = await make_worker(body=b"a"), await make_worker(body=b"b")
    router = await make_router([a.url, b.url], enable_admin_api=True)
    wid = router.registry.get(a.url).id
    async with client.put(router.url + "/workers/" + wid, json={"disabled": True}) as resp:
        body = await resp.json()
        assert (
            body["disabled"] is True and body["routable"] is False and body["health"] == "healthy"
        )
    for _ in range(3):
        async with client.post(router.url + CHAT, data=b"{}") as resp:
            assert await resp.read() == b"b"
    probes = a.num_health_probes
    await wait_for(lambda: a.num_health_probes > probes, what="probes of a disabled worker")
    async with client.put(router.url + "/workers/" + wid, json={"disabled": False}) as resp:
        assert (await resp.json())["routable"] is True
    await assert_idle(router)


async def test_dead_is_a_quarantine_until_recovered(make_worker, make_router, client):
    worker = await make_worker()
    router = await make_router([worker.url], enable_admin_api=True)
    wid = router.registry.get(worker.url).id
    async with client.put(router.url + "/workers/" + wid, json={"dead": True}) as resp:
        assert (await resp.json())["health"] == "dead"
    probes = worker.num_health_probes
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 503
    state = router.registry.get(worker.url)
    router.registry.record_probe(state, 200, None)  # a late probe answer changes nothing
    assert state.health is HealthState.DEAD
    await asyncio.sleep(0.2)  # four probe intervals
    assert worker.num_health_probes == probes, "dead workers are not probed"
    async with client.put(router.url + "/workers/" + wid, json={"dead": False}) as resp:
        assert (await resp.json())["health"] == "unknown"
    await wait_for(lambda: worker.num_health_probes > probes, timeout=1.0, what="probe at once")
    await wait_for(lambda: state.health is HealthState.HEALTHY, what="healthy after recovery")
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 200
    await assert_idle(router)


async def test_models_are_merged_deduplicated_and_failures_detailed(
    make_worker, make_router, client
):
    a = await make_worker(models=[{"id": "m1", "owned_by": "a"}, {"id": "shared", "owned_by": "a"}])
    b = await make_worker(models=[{"id": "shared", "owned_by": "b"}, {"id": "m2"}])
    broken = await make_worker(models=None)  # answers 500
    router = await make_router([a.url, b.url, broken.url])
    async with client.get(router.url + "/v1/models") as resp:
        body = await resp.json()
    assert resp.status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["m1", "shared", "m2"]
    only_broken = await make_router([broken.url])
    async with client.get(only_broken.url + "/v1/models") as resp:
        assert resp.status == 502
        details = (await resp.json())["error"]["workers"]
        assert details == [{"worker": broken.url, "error": "answered 500"}]


async def test_metrics_report_requests_selections_health_retries_active(
    make_worker, make_router, client
):
    worker = await make_worker()
    router = await make_router([worker.url, closed_port_url()], wait_healthy=False)
    await wait_for(lambda: router.registry.get(worker.url).is_routable, what="healthy")
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 200
    await assert_idle(router)
    async with client.get(router.url + "/metrics") as resp:
        text = await resp.text()
        assert resp.headers["Content-Type"].startswith("text/plain")
    assert f'cadence_router_requests_total{{route="{CHAT}",status="200"}} 1.0' in text
    assert f'cadence_router_request_duration_seconds_count{{route="{CHAT}"}} 1.0' in text
    assert f'cadence_router_worker_selections_total{{worker="{worker.url}"}} 1.0' in text
    assert f'cadence_router_worker_health{{state="healthy",worker="{worker.url}"}} 1.0' in text
    assert f'cadence_router_worker_health{{state="unknown",worker="{worker.url}"}} 0.0' in text
    assert f'cadence_router_worker_routable{{worker="{worker.url}"}} 1.0' in text
    assert f'cadence_router_worker_active_requests{{worker="{worker.url}"}} 0.0' in text
    assert "cadence_router_active_requests 0.0" in text
    assert "cadence_router_retries_total" in text


async def test_api_key_guards_everything_but_liveness(make_worker, make_router, client):
    worker = await make_worker()
    # The admin API served behind the client key (no admin key of its own).
    router = await make_router([worker.url], api_key="s3cret", enable_admin_api=True)
    for path in ("/live", "/ready", "/health"):
        async with client.get(router.url + path) as resp:
            assert resp.status == 200, path
    for method, path in (
        ("POST", CHAT),
        ("GET", "/workers"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
    ):
        async with client.request(method, router.url + path, data=b"{}") as resp:
            assert resp.status == 401, path
        async with client.request(
            method, router.url + path, headers={"Authorization": "Bearer nope"}
        ) as resp:
            assert resp.status == 401, path
    async with client.post(
        router.url + CHAT, data=b"{}", headers={"Authorization": "Bearer s3cret"}
    ) as resp:
        assert resp.status == 200
    async with client.get(
        router.url + "/workers", headers={"Authorization": "Bearer s3cret"}
    ) as resp:
        assert resp.status == 200
    assert worker.received[0].headers["Authorization"] == "Bearer s3cret"  # passed on to the worker
    assert worker.num_requests == 1
    await assert_idle(router)
