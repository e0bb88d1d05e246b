"""Failure paths: retries, timeouts, broken streams, disconnects, health transitions.

Each test ends with every active count back to zero.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from router_fakes import assert_idle, wait_for

from cadence.router.workers import HealthState

CHAT = "/v1/chat/completions"
EVENTS = [b"data: %d\n\n" % i for i in range(10)]


async def test_retry_on_connection_refused_reaches_the_live_worker(
    make_worker, make_router, client
):
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


async def test_all_attempts_refused_gives_502_and_marks_worker_unhealthy(
    make_worker, make_router, client
):
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


async def test_a_5xx_the_replica_blames_on_the_request_is_relayed_not_retried(
    make_worker, make_router, client
):
    answer = b'{"error": {"message": "prompt breaks the tokenizer", "code": 500}}'
    fault = {"X-Cadence-Fault": "request", "X-Upstream": "kept"}
    a = await make_worker(status=500, body=answer, extra_headers=fault)
    b = await make_worker(status=500, body=answer, extra_headers=fault)
    router = await make_router([a.url, b.url], health_failure_threshold=1, retry_max_retries=3)
    for i in range(4):
        async with client.post(router.url + CHAT, data=b'{"n": %d}' % i) as resp:
            assert resp.status == 500
            assert await resp.read() == answer
            assert resp.headers["Content-Type"] == "application/json"
            assert (
                resp.headers["X-Cadence-Fault"] == "request"
                and resp.headers["X-Upstream"] == "kept"
            )
        assert a.num_requests + b.num_requests == i + 1  # exactly one worker per request
    assert a.num_requests == b.num_requests == 2  # round robin, no retries in between
    for worker in (a, b):
        state = router.registry.get(worker.url)
        assert state.health is HealthState.HEALTHY and state.is_routable
        assert state.num_failures == 0 and state.consecutive_failures == 0
    async with client.get(router.url + "/metrics") as resp:
        assert f'cadence_router_retries_total{{route="{CHAT}"}}' not in await resp.text()
    await assert_idle(router)


async def test_a_plain_500_is_still_retried_on_another_worker(make_worker, make_router, client):
    failing = await make_worker(status=500, body=b'{"error": "engine crashed"}')
    good = await make_worker(body=b"good")
    router = await make_router([failing.url, good.url], health_failure_threshold=2)
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 200 and await resp.read() == b"good"
    assert failing.num_requests == 1 and good.num_requests == 1
    assert router.registry.get(failing.url).consecutive_failures == 1  # counted against it
    await assert_idle(router)


@pytest.mark.parametrize(
    ("status", "headers", "is_retried"),
    [
        (408, {}, True),
        (429, {}, True),
        (500, {}, True),
        (502, {}, True),
        (503, {}, True),
        (504, {}, True),
        (500, {"X-Cadence-Fault": "other"}, True),  # only "request" says the request is at fault
        (400, {}, False),
        (404, {}, False),
        (413, {}, False),
        (422, {}, False),
        (500, {"X-Cadence-Fault": "request"}, False),
        (503, {"x-cadence-fault": " Request "}, False),
    ],
)
async def test_which_answers_are_retried(
    make_worker, make_router, client, status, headers, is_retried
):
    first = await make_worker(status=status, body=b"first", extra_headers=headers)
    second = await make_worker(body=b"second")
    router = await make_router([first.url, second.url])
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert (resp.status, await resp.read()) == (
            (200, b"second") if is_retried else (status, b"first")
        )
    assert (first.num_requests, second.num_requests) == (1, int(is_retried))
    await assert_idle(router)


async def test_started_stream_is_never_replayed_and_cut_is_visible(
    make_worker, make_router, client
):
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
