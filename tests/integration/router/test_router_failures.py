"""Failure paths: retries, timeouts, broken streams, disconnects, health transitions.

Each test ends with every active count back to zero.
"""

from __future__ import annotations

import asyncio

import aiohttp
from router_fakes import assert_idle, wait_for

from cadence.router.workers import HealthState

CHAT = "/v1/chat/completions"
EVENTS = [b"data: %d\n\n" % i for i in range(10)]


async def test_retry_on_connection_refused_reaches_the_live_worker(make_worker, make_router, client):
    doomed = await make_worker(body=b"doomed")
    live = await make_worker(body=b"live")
    # Probes only at startup: the stopped worker stays routable until requests fail.
    router = await make_router([doomed.url, live.url], health_check_interval_secs=60,
                               health_failure_threshold=100)  # fmt: skip
    await doomed.stop()  # connections to it are now refused
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 200
        assert await resp.read() == b"live"
        assert resp.headers["x-cadence-worker"] == live.url
    state = router.registry.get(doomed.url)
    assert state.num_requests == 1 and state.num_failures == 1
    assert "Connect" in state.last_error or "Disconnected" in state.last_error
    assert live.num_requests == 1
    await assert_idle(router)


async def test_all_attempts_refused_gives_502_and_marks_worker_unhealthy(make_worker, make_router, client):
    doomed = await make_worker()
    router = await make_router([doomed.url], retry_max_retries=2, health_failure_threshold=3,
                               health_check_interval_secs=60)  # fmt: skip
    await doomed.stop()
    state = router.registry.get(doomed.url)
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 502
        assert "after 3 attempt(s)" in (await resp.json())["error"]["message"]
    assert state.num_requests == 3
    assert state.health is HealthState.UNHEALTHY  # 3 passive failures = the threshold
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 503  # nobody routable any more
    await assert_idle(router)


async def test_5xx_is_retried_elsewhere_and_final_5xx_is_relayed(make_worker, make_router, client):
    failing = await make_worker(status=503, body=b'{"error": "overloaded"}')
    good = await make_worker(body=b"good")
    router = await make_router([failing.url, good.url])
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert await resp.read() == b"good"
    assert failing.num_requests == 1 and good.num_requests == 1
    solo = await make_router([failing.url], retry_max_retries=1)
    async with client.post(solo.url + CHAT, data=b"{}") as resp:
        assert resp.status == 503
        assert await resp.read() == b'{"error": "overloaded"}'  # the worker's own answer
        assert resp.headers["x-cadence-worker"] == failing.url
    assert failing.num_requests == 3
    await assert_idle(router)
    await assert_idle(solo)


async def test_started_stream_is_never_replayed_and_cut_is_visible(make_worker, make_router, client):
    breaking = await make_worker(mode="break", events=EVENTS)
    other = await make_worker(mode="sse", events=EVENTS)
    router = await make_router([breaking.url, other.url])
    received = bytearray()
    truncated = False
    try:
        async with client.post(router.url + CHAT, data=b'{"stream": true}') as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                received += chunk
    except aiohttp.ClientPayloadError:
        truncated = True
    assert truncated, "a stream cut upstream must not end cleanly for the client"
    assert bytes(received) == b"".join(EVENTS[:5])
    assert breaking.num_requests == 1 and other.num_requests == 0  # no replay
    assert router.registry.get(breaking.url).num_failures == 1
    await assert_idle(router)


async def test_client_disconnect_mid_stream_closes_the_upstream_stream(make_worker, make_router):
    slow_events = [b"data: %d\n\n" % i for i in range(500)]
    worker = await make_worker(mode="sse", events=slow_events, event_gap_secs=0.01)
    router = await make_router([worker.url])
    async with aiohttp.ClientSession() as session:
        resp = await session.post(router.url + CHAT, data=b'{"stream": true}')
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first == b"data: 0\n\n"
        resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(worker.stream_closed.wait(), timeout=2.0)
    assert worker.num_events_written < len(slow_events)
    await assert_idle(router)
    assert router.registry.get(worker.url).num_failures == 0  # not the worker's fault


async def test_client_disconnect_before_answer_cancels_upstream_request(make_worker, make_router):
    worker = await make_worker(mode="hang")
    router = await make_router([worker.url])
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(router.url + CHAT, data=b"{}"))
        await asyncio.wait_for(worker.handler_started.wait(), 2.0)
        assert router.registry.get(worker.url).active == 1
        task.cancel()
    await assert_idle(router)


async def test_hanging_upstream_times_out_with_504(make_worker, make_router, client):
    worker = await make_worker(mode="hang")
    router = await make_router([worker.url], request_timeout_secs=0.2)
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 504
        assert "did not answer" in (await resp.json())["error"]["message"]
    assert worker.num_requests == 1  # a timeout is not retried
    assert router.registry.get(worker.url).consecutive_failures == 1
    await assert_idle(router)


async def test_worker_goes_unhealthy_and_back_through_probes(make_worker, make_router, client):
    worker = await make_worker()
    router = await make_router([worker.url], health_failure_threshold=2, health_success_threshold=2)
    state = router.registry.get(worker.url)
    worker.health_status = 503
    await wait_for(lambda: state.health is HealthState.UNHEALTHY, what="unhealthy")
    assert state.last_status == 503 and state.consecutive_failures >= 2
    async with client.get(router.url + "/ready") as resp:
        assert resp.status == 503
    worker.health_status = 200
    await wait_for(lambda: state.health is HealthState.HEALTHY, what="healthy again")
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 200
    await assert_idle(router)


async def test_new_worker_starts_unknown_and_needs_the_success_threshold(make_worker, make_router):
    worker = await make_worker()
    router = await make_router([worker.url], wait_healthy=False, health_success_threshold=3,
                               health_check_startup_interval_secs=0.05)  # fmt: skip
    state = router.registry.get(worker.url)
    assert state.health is HealthState.UNKNOWN and not state.is_routable
    await wait_for(lambda: state.health is HealthState.HEALTHY, what="healthy")
    assert worker.num_health_probes >= 3


async def test_least_request_sends_to_the_idle_worker(make_worker, make_router, client):
    busy = await make_worker(mode="hang")
    idle = await make_worker(body=b"idle")
    router = await make_router([busy.url, idle.url], policy="least_request")
    hanging = asyncio.create_task(client.post(router.url + CHAT, data=b"{}"))
    await asyncio.wait_for(busy.handler_started.wait(), 2.0)
    for _ in range(3):
        async with client.post(router.url + CHAT, data=b"{}") as resp:
            assert await resp.read() == b"idle"
    hanging.cancel()
    await assert_idle(router)
