"""PD mode failures: either side failing, hanging or answering 4xx, and the client leaving.

Each case must end quickly with a clear answer (the router's JSON error naming the side
and its URL, or the worker's own 4xx), cancel the other side's request (the fake server
sees its connection closed, as a Cadence server would, which then aborts the request and
frees its pages), and give back every active count.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from router_fakes import assert_idle, raw_exchange

from cadence.router.workers import HealthState

GENERATE = "/generate"
CHAT = "/v1/chat/completions"
NO_RETRY = {"retry_max_retries": 0}


async def error_of(resp: aiohttp.ClientResponse) -> dict:
    return (await resp.json())["error"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_5xx_cancels_decode_and_names_the_prefill_side(
    make_server, make_pd_router, client, stream
):
    prefill = await make_server("prefill", status=500, answer={"error": "engine crashed"})
    decode = await make_server("decode", mode="hang")
    router = await make_pd_router([(prefill, 8998)], [decode], **NO_RETRY)
    started = time.monotonic()
    async with client.post(router.url + GENERATE, json={"text": "x", "stream": stream}) as resp:
        assert resp.status == 502
        error = await error_of(resp)
    assert time.monotonic() - started < 2.0
    assert error["role"] == "prefill" and error["worker"] == prefill.url
    assert f"prefill worker {prefill.url} answered 500" in error["message"]
    assert "engine crashed" in error["message"]
    await asyncio.wait_for(decode.cancelled.wait(), 2.0)
    await assert_idle(router)


async def test_a_decode_5xx_cancels_prefill_and_names_the_decode_side(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill", mode="hang")
    decode = await make_server("decode", status=503, answer={"error": "draining"})
    router = await make_pd_router([(prefill, 8998)], [decode], **NO_RETRY)
    async with client.post(router.url + CHAT, json={"messages": []}) as resp:
        assert resp.status == 502
        error = await error_of(resp)
    assert error["role"] == "decode" and error["worker"] == decode.url
    assert f"decode worker {decode.url} answered 503" in error["message"]
    await asyncio.wait_for(prefill.cancelled.wait(), 2.0)
    await assert_idle(router)


async def test_a_refused_decode_connection_cancels_prefill_and_counts_against_decode(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill", mode="hang")
    decode = await make_server("decode")
    # Probes only at startup: the stopped decode server stays routable until requests fail.
    router = await make_pd_router([(prefill, 8998)], [decode], health_check_interval_secs=60,
                                  health_failure_threshold=1, **NO_RETRY)  # fmt: skip
    await decode.stop()
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert resp.status == 502
        error = await error_of(resp)
    assert error["role"] == "decode" and f"decode worker {decode.url} failed" in error["message"]
    await asyncio.wait_for(prefill.cancelled.wait(), 2.0)
    state = router.registry.get(decode.url)
    assert state.health is HealthState.UNHEALTHY and not state.is_routable
    assert router.registry.get(prefill.url).is_routable  # the healthy side is not blamed
    async with client.get(router.url + "/metrics") as resp:
        text = await resp.text()
    assert f'cadence_router_pd_failures_total{{role="decode",worker="{decode.url}"}} 1.0' in text
    await assert_idle(router)


async def test_a_hanging_prefill_times_out_and_cancels_decode(make_server, make_pd_router, client):
    prefill = await make_server("prefill", mode="hang")
    decode = await make_server("decode", mode="hang")  # waits for KV that never comes
    router = await make_pd_router([(prefill, 8998)], [decode], request_timeout_secs=0.5)
    started = time.monotonic()
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert resp.status == 504
        error = await error_of(resp)
    assert time.monotonic() - started < 2.0  # the timeout, not a retry per attempt
    assert error["role"] == "prefill" and error["type"] == "gateway_timeout"
    assert f"prefill worker {prefill.url} did not answer within 0.5s" in error["message"]
    await asyncio.wait_for(decode.cancelled.wait(), 2.0)
    assert len(prefill.bodies) == len(decode.bodies) == 1  # timeouts are not retried
    await assert_idle(router)


@pytest.mark.parametrize("failing", ["prefill", "decode"])
async def test_a_4xx_from_either_side_is_relayed_as_it_is_and_cancels_the_other(
    make_server, make_pd_router, client, failing
):
    answer = {"error": {"message": "max_new_tokens: must be >= 0", "code": 400}}
    bad = {"status": 400, "answer": answer}
    prefill = await make_server("prefill", **(bad if failing == "prefill" else {"mode": "hang"}))
    decode = await make_server("decode", **(bad if failing == "decode" else {"mode": "hang"}))
    router = await make_pd_router([(prefill, 8998)], [decode])
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert resp.status == 400
        assert await resp.json() == answer
        assert resp.headers["X-Side"] == failing
    other = decode if failing == "prefill" else prefill
    await asyncio.wait_for(other.cancelled.wait(), 2.0)
    assert len(prefill.bodies) == 1  # a request fault is never retried
    for worker in router.registry:
        assert worker.is_routable and worker.num_failures == 0
    await assert_idle(router)


async def test_a_failed_pair_is_retried_on_another_prefill_worker(
    make_server, make_pd_router, client
):
    doomed = await make_server("prefill")
    live = await make_server("prefill")
    decode = await make_server("decode", answer={"text": "done"})
    router = await make_pd_router([(doomed, 9001), (live, 9002)], [decode],
                                  health_check_interval_secs=60)  # fmt: skip
    await doomed.stop()
    for _ in range(2):
        async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
            assert resp.status == 200 and await resp.json() == {"text": "done"}
            assert resp.headers["x-cadence-prefill-worker"] == live.url
    # The decode request of the failed attempt was cancelled, the retry got a new room.
    rooms = [b["bootstrap_room"] for b in decode.bodies]
    assert len(rooms) == len(set(rooms))
    assert {b["bootstrap_port"] for b in decode.bodies if b in live.bodies} == {9002}
    await assert_idle(router)


async def test_a_prefill_failure_mid_stream_ends_the_stream_with_an_error_event(
    make_server, make_pd_router
):
    prefill = await make_server("prefill", status=500, delay_secs=0.2, answer={"error": "died"})
    first = b'data: {"text": "a"}\n\n'
    decode = await make_server("decode", mode="hang_after_headers", events=[first])
    router = await make_pd_router([(prefill, 8998)], [decode], **NO_RETRY)
    body = b'{"text": "x", "stream": true}'
    head = f"POST {GENERATE} HTTP/1.1\r\nHost: r\r\nContent-Length: {len(body)}\r\n\r\n"
    started = time.monotonic()
    # A raw socket: reads every byte up to the cut (a client library drops what is buffered
    # when the connection breaks).
    status, headers, raw = await raw_exchange(router.url, head.encode() + body)
    assert time.monotonic() - started < 2.0
    assert status == 200  # the decode side's headers were relayed before the prefill failed
    assert headers["Transfer-Encoding"] == "chunked" and not raw.endswith(b"0\r\n\r\n")  # cut
    assert first in raw
    error = json.loads(raw[raw.index(b'data: {"error"') + 6 :].split(b"\n\n")[0])["error"]
    assert f"prefill worker {prefill.url} answered 500" in error["message"]
    await asyncio.wait_for(decode.cancelled.wait(), 2.0)
    await assert_idle(router)


async def test_a_decode_stream_that_breaks_cancels_prefill(make_server, make_pd_router):
    prefill = await make_server("prefill", mode="hang")
    decode = await make_server(
        "decode", mode="break_after_headers", events=[b"data: 1\n\n"], event_gap_secs=0.1
    )
    router = await make_pd_router([(prefill, 8998)], [decode], **NO_RETRY)
    body = b'{"messages": [], "stream": true}'
    head = f"POST {CHAT} HTTP/1.1\r\nHost: r\r\nContent-Length: {len(body)}\r\n\r\n"
    status, _, raw = await raw_exchange(router.url, head.encode() + body)
    assert status == 200 and b"data: 1\n\n" in raw
    assert f"stream broke: decode worker {decode.url} failed".encode() in raw
    assert not raw.endswith(b"0\r\n\r\n")
    await asyncio.wait_for(prefill.cancelled.wait(), 2.0)
    await assert_idle(router)


async def test_a_client_that_leaves_cancels_both_sides(make_server, make_pd_router, client):
    prefill = await make_server("prefill", mode="hang")
    decode = await make_server("decode", mode="hang_after_headers", events=[b"data: 1\n\n"])
    router = await make_pd_router([(prefill, 8998)], [decode])
    resp = await client.post(router.url + CHAT, json={"messages": [], "stream": True})
    assert await resp.content.readuntil(b"\n\n") == b"data: 1\n\n"
    resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(decode.cancelled.wait(), 2.0)
    await asyncio.wait_for(prefill.cancelled.wait(), 2.0)
    await assert_idle(router)


async def test_a_client_that_leaves_before_any_answer_cancels_both_sides(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill", mode="hang")
    decode = await make_server("decode", mode="hang")
    router = await make_pd_router([(prefill, 8998)], [decode])
    request = asyncio.create_task(client.post(router.url + GENERATE, json={"text": "x"}))
    await asyncio.wait_for(asyncio.gather(prefill.started.wait(), decode.started.wait()), 2.0)
    request.cancel()  # closes the client's connection
    await asyncio.wait_for(decode.cancelled.wait(), 2.0)
    await asyncio.wait_for(prefill.cancelled.wait(), 2.0)
    await assert_idle(router)


async def test_a_prefill_still_running_after_decode_answered_is_left_to_finish(
    make_server, make_pd_router, client
):
    prefill = await make_server("prefill", delay_secs=0.3)  # acknowledges after decode is done
    decode = await make_server("decode", answer={"text": "done"})
    router = await make_pd_router([(prefill, 8998)], [decode])
    async with client.post(router.url + GENERATE, json={"text": "x"}) as resp:
        assert await resp.json() == {"text": "done"}
    state = router.registry.get(prefill.url)
    assert state.active == 1  # still counted while it runs
    await assert_idle(router)  # and given back once it finished
    assert prefill.num_cancelled == 0
