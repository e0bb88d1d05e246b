"""Forwarding and relaying through a real router to real upstream servers."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from router_fakes import assert_idle
from yarl import URL

CHAT = "/v1/chat/completions"


async def test_body_query_and_answer_are_relayed_byte_for_byte(make_worker, make_router, client):
    answer = os.urandom(4096)  # not JSON, not UTF-8: relayed as opaque bytes
    worker = await make_worker(body=answer, content_type="application/octet-stream",
                               extra_headers={"X-Upstream": "yes"})  # fmt: skip
    router = await make_router([worker.url])
    body = b'{"model": "m",  "messages": [{"role":"user","content":"h\\u00e9"}], "x": 1.50}'
    target = URL(router.url + CHAT + "?a=1&b=%2F&c", encoded=True)  # the client must not requote
    async with client.post(target, data=body,
                           headers={"Content-Type": "application/json", "X-Custom": "kept"}) as resp:  # fmt: skip
        assert resp.status == 200
        assert await resp.read() == answer
        assert resp.headers["X-Upstream"] == "yes"
        assert resp.headers["x-cadence-worker"] == worker.url
        assert len(resp.headers["x-cadence-request-id"]) == 32
    got = worker.received[0]
    assert got.body == body
    assert got.path_qs == CHAT + "?a=1&b=%2F&c"
    assert got.headers["X-Custom"] == "kept"
    assert got.headers["Content-Type"] == "application/json"
    assert got.headers["x-cadence-request-id"] == resp.headers["x-cadence-request-id"]
    await assert_idle(router)


async def test_hop_by_hop_headers_are_stripped_both_ways(make_worker, make_router, client):
    worker = await make_worker(extra_headers={"Keep-Alive": "timeout=5", "X-Drop-Me": "1",
                                              "Connection": "X-Drop-Me"})  # fmt: skip
    router = await make_router([worker.url])
    headers = {"Connection": "keep-alive, X-Secret-Hop", "X-Secret-Hop": "1", "TE": "trailers",
               "Proxy-Authorization": "Basic eA==", "Upgrade": "h2c", "X-Kept": "1"}  # fmt: skip
    async with client.post(router.url + CHAT, data=b"{}", headers=headers) as resp:
        assert resp.status == 200
        assert "X-Drop-Me" not in resp.headers
        assert "Keep-Alive" not in resp.headers
    sent = {k.lower() for k in worker.received[0].headers}
    assert "x-kept" in sent
    assert not sent & {"x-secret-hop", "te", "proxy-authorization", "upgrade"}
    # aiohttp's own client speaks keep-alive to the worker; the client's value never passes.
    assert worker.received[0].headers.get("Connection", "keep-alive").lower() == "keep-alive"
    await assert_idle(router)


async def test_sse_stream_is_relayed_byte_exact_and_unframed(make_worker, make_router, client):
    events = [b'data: {"i": %d}\n\n' % i for i in range(20)] + [
        b": comment\r\n\r\n",
        b"data: [DONE]\n\n",
    ]
    worker = await make_worker(mode="sse", events=events, event_gap_secs=0.001)
    router = await make_router([worker.url])
    received = bytearray()
    async with client.post(router.url + CHAT, data=b'{"stream": true}') as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers["x-cadence-worker"] == worker.url
        async for chunk in resp.content.iter_any():
            received += chunk
    assert bytes(received) == b"".join(events)
    await assert_idle(router)


async def test_compressed_answer_is_relayed_compressed(make_worker, make_router, client):
    import gzip

    payload = gzip.compress(b'{"a": 1}' * 100)
    worker = await make_worker(body=payload, extra_headers={"Content-Encoding": "gzip"})
    router = await make_router([worker.url])
    async with client.post(
        router.url + CHAT, data=b"{}", headers={"Accept-Encoding": "gzip"}
    ) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        assert await resp.read() == payload
    assert worker.received[0].headers["Accept-Encoding"] == "gzip"
    await assert_idle(router)


async def test_413_with_content_length_before_any_worker_is_chosen(
    make_worker, make_router, client
):
    worker = await make_worker()
    router = await make_router([worker.url], max_payload_size=1000)
    async with client.post(router.url + CHAT, data=b"x" * 1001) as resp:
        assert resp.status == 413
        assert "max-payload-size" in (await resp.json())["error"]["message"]
    async with client.post(router.url + CHAT, data=b"x" * 1000) as resp:
        assert resp.status == 200  # exactly the limit passes
    assert worker.num_requests == 1
    assert router.registry.routable[0].num_requests == 1
    await assert_idle(router)


async def test_413_without_content_length_counts_while_reading(make_worker, make_router, client):
    worker = await make_worker()
    router = await make_router([worker.url], max_payload_size=1000)

    async def chunks(total: int):
        for _ in range(total // 100):
            yield b"y" * 100

    async with client.post(router.url + CHAT, data=chunks(5000)) as resp:
        assert resp.status == 413
    async with client.post(router.url + CHAT, data=chunks(900)) as resp:
        assert resp.status == 200
    assert worker.num_requests == 1 and worker.received[0].body == b"y" * 900
    await assert_idle(router)


async def test_429_when_concurrency_limit_is_reached(make_worker, make_router, client):
    worker = await make_worker(mode="slow", delay_secs=0.3)
    router = await make_router([worker.url], max_concurrent_requests=2)
    first = [asyncio.create_task(client.post(router.url + CHAT, data=b"{}")) for _ in range(2)]
    await asyncio.wait_for(_until(lambda: worker.num_requests == 2), 5)
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "1"  # whole seconds, at least 1
        assert (await resp.json())["error"]["type"] == "overloaded"
    for task in first:
        resp = await task
        assert resp.status == 200
        resp.release()
    await assert_idle(router)


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


async def test_503_when_no_worker_fits_model_or_capabilities(
    make_worker, make_router, client, tmp_path
):
    chat_worker = await make_worker(body=b'{"who": "chat"}')
    embed_worker = await make_worker(body=b'{"who": "embed"}')
    config = tmp_path / "workers.yaml"
    config.write_text(
        f"- url: {chat_worker.url}\n  model: small\n  capabilities: [chat, streaming]\n"
        f"- url: {embed_worker.url}\n  model: embedder\n  capabilities: [embedding]\n"
    )
    router = await make_router([], wait_healthy=False, worker_config=str(config))
    await _wait_routable(router, 2)
    async with client.post(router.url + CHAT, json={"model": "small", "stream": True}) as resp:
        assert (await resp.read()) == b'{"who": "chat"}'
    async with client.post(
        router.url + "/v1/embeddings", json={"model": "embedder", "input": "x"}
    ) as resp:
        assert (await resp.read()) == b'{"who": "embed"}'
    async with client.post(router.url + CHAT, json={"model": "other"}) as resp:
        assert resp.status == 503
        assert "'other'" in (await resp.json())["error"]["message"]
    async with client.post(router.url + CHAT, json={"model": "x" * 100000}) as resp:
        assert resp.status == 503
        assert (
            len((await resp.json())["error"]["message"]) < 400
        )  # the name is cut, not echoed whole
    async with client.post(router.url + "/v1/embeddings", json={"model": "small"}) as resp:
        assert resp.status == 503  # right model, missing capability
    image_chat = {"model": "small", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}  # fmt: skip
    async with client.post(router.url + CHAT, json=image_chat) as resp:
        assert resp.status == 503
        assert "image_input" in (await resp.json())["error"]["message"]
    assert chat_worker.num_requests == 1 and embed_worker.num_requests == 1
    await assert_idle(router)


async def _wait_routable(router, count: int) -> None:
    await asyncio.wait_for(_until(lambda: len(router.registry.routable) == count), 5)


async def test_round_robin_spreads_and_least_request_avoids_busy(make_worker, make_router, client):
    a, b = await make_worker(body=b"a"), await make_worker(body=b"b")
    router = await make_router([a.url, b.url])
    seen = []
    for _ in range(4):
        async with client.post(router.url + CHAT, data=b"{}") as resp:
            seen.append(await resp.read())
    assert seen == [b"a", b"b", b"a", b"b"]
    await assert_idle(router)


@pytest.mark.parametrize("route", ["/v1/completions", "/generate", "/v1/embeddings", "/v1/audio/speech",
                                   "/v1/rerank", "/v1/score"])  # fmt: skip
async def test_every_inference_route_is_forwarded(make_worker, make_router, client, route):
    worker = await make_worker()
    router = await make_router([worker.url])
    async with client.post(router.url + route, data=b'{"input": "x"}') as resp:
        assert resp.status == 200
    assert worker.received[0].path_qs == route
    async with client.post(router.url + "/v1/not-a-route", data=b"{}") as resp:
        assert resp.status == 404  # no catch-all proxy
    assert worker.num_requests == 1
    await assert_idle(router)


async def test_worker_4xx_is_relayed_and_never_counts_as_failure(make_worker, make_router, client):
    worker = await make_worker(status=400, body=b'{"error": "bad"}')
    router = await make_router([worker.url], health_failure_threshold=1)
    for _ in range(3):
        async with client.post(router.url + CHAT, data=b"{}") as resp:
            assert resp.status == 400
            assert await resp.read() == b'{"error": "bad"}'
    state = router.registry.routable[0]
    assert (
        state.health.value == "healthy"
        and state.consecutive_failures == 0
        and state.num_failures == 0
    )
    assert worker.num_requests == 3  # 4xx is never retried either
    await assert_idle(router)


async def test_route_log_lines_and_write_failures_do_not_fail_requests(
    make_worker, make_router, client, tmp_path
):
    worker = await make_worker()
    log = tmp_path / "routes.jsonl"
    router = await make_router([worker.url], route_log=str(log))
    async with client.post(router.url + CHAT, json={"model": "m", "stream": False}) as resp:
        rid = resp.headers["x-cadence-request-id"]
    await assert_idle(router)
    line = json.loads(log.read_text().splitlines()[0])
    assert line["rid"] == rid and line["status"] == 200 and line["worker"] == worker.url
    assert line["model"] == "m" and line["attempts"] == 1 and line["route"] == CHAT
    if os.path.exists("/dev/full"):  # every write fails with ENOSPC
        full = await make_router([worker.url], route_log="/dev/full")
        for _ in range(2):
            async with client.post(full.url + CHAT, data=b"{}") as resp:
                assert resp.status == 200
        assert full.route_log.num_write_errors == 2
        await assert_idle(full)


async def test_large_bodies_both_ways_are_exact(make_worker, make_router, client):
    answer = os.urandom(3 * 1024 * 1024)  # over the 1 MiB buffering limit: relayed in chunks
    worker = await make_worker(body=answer, content_type="application/octet-stream")
    router = await make_router([worker.url])
    upload = os.urandom(5 * 1024 * 1024)
    async with client.post(router.url + "/v1/embeddings", data=upload) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Length"] == str(len(answer))
        assert await resp.read() == answer
    assert worker.received[0].body == upload
    await assert_idle(router)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m\xff\xfe", "messages": [{"role": "user", "content": "hi"}]}',  # invalid UTF-8
        b"\xff\xfe{\x00}\x00",  # UTF-16
        b'{"model": "m", "messages": [',  # cut short
        b'{"model": "m", "x": '
        + b"[" * 100000
        + b"]" * 100000
        + b"}",  # nested past the parser's limit
    ],
    ids=["invalid-utf8", "utf16", "truncated", "deep"],
)
async def test_bodies_the_router_cannot_read_are_forwarded_unchanged(
    make_worker, make_router, client, body
):
    worker = await make_worker(
        mode="echo", status=400
    )  # the worker judges the body and answers 400
    router = await make_router([worker.url])
    async with client.post(
        router.url + CHAT, data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        assert await resp.read() == body  # what the worker received, echoed back
        assert resp.headers["x-cadence-worker"] == worker.url
    assert worker.num_requests == 1 and worker.received[0].body == body
    state = router.registry.get(worker.url)
    assert state.num_failures == 0 and state.is_routable
    await assert_idle(router)
