"""The admin API: who may use it, how big and how well-formed its bodies must be, worker ids.

Admin routes: GET/POST /workers, GET/PUT/DELETE /workers/{id}.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest
from router_fakes import raw_exchange

from cadence.router.admin import MAX_ADMIN_BODY_BYTES

CHAT = "/v1/chat/completions"
ADMIN_KEY, CLIENT_KEY = "admin-s3cret", "client-s3cret"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _admin_calls(client, router, worker_url: str, headers: dict[str, str]) -> list[int]:
    """One call to each admin route; DELETE last, on a worker that POST added."""
    extra = "http://127.0.0.1:9"
    wid = quote(worker_url, safe="")
    statuses = []
    for method, path, body in (
        ("GET", "/workers", None),
        ("GET", "/workers/" + wid, None),
        ("POST", "/workers", {"url": extra}),
        ("PUT", "/workers/" + wid, {"disabled": False}),
        ("DELETE", "/workers/" + quote(extra, safe=""), None),
    ):
        async with client.request(method, router.url + path, json=body, headers=headers) as resp:
            statuses.append(resp.status)
            if resp.status >= 400:
                error = (await resp.json())["error"]
                assert error["code"] == resp.status and error["message"]
    return statuses


async def test_admin_routes_are_off_by_default_and_say_how_to_turn_them_on(
    make_worker, make_router, client
):
    worker = await make_worker()
    router = await make_router([worker.url], api_key=CLIENT_KEY)
    for headers in ({}, _bearer(CLIENT_KEY)):
        assert await _admin_calls(client, router, worker.url, headers) == [403] * 5
    async with client.get(router.url + "/workers", headers=_bearer(CLIENT_KEY)) as resp:
        message = (await resp.json())["error"]["message"]
    assert "--admin-api-key" in message and "--enable-admin-api" in message
    assert len(router.registry) == 1  # the refused POST added nothing
    async with client.post(router.url + CHAT, data=b"{}", headers=_bearer(CLIENT_KEY)) as resp:
        assert resp.status == 200  # client routes are untouched


async def test_admin_key_opens_admin_routes_and_nothing_else_does(make_worker, make_router, client):
    worker = await make_worker()
    router = await make_router([worker.url], api_key=CLIENT_KEY, admin_api_key=ADMIN_KEY)
    for headers in ({}, _bearer(CLIENT_KEY), _bearer("wrong"), {"Authorization": ADMIN_KEY},
                    {"Authorization": f"Basic {ADMIN_KEY}"}):  # fmt: skip
        statuses = await _admin_calls(client, router, worker.url, headers)
        assert statuses == [401] * 5, headers
    async with client.get(router.url + "/workers", headers=_bearer(CLIENT_KEY)) as resp:
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert "admin key" in (await resp.json())["error"]["message"]
    assert len(router.registry) == 1
    assert await _admin_calls(client, router, worker.url, _bearer(ADMIN_KEY)) == [
        200,
        200,
        201,
        200,
        200,
    ]
    async with client.get(
        router.url + "/workers", headers={"Authorization": f"bearer  {ADMIN_KEY}"}
    ) as resp:
        assert resp.status == 200  # the scheme is case-insensitive
    async with client.post(router.url + CHAT, data=b"{}", headers=_bearer(ADMIN_KEY)) as resp:
        assert resp.status == 401  # the admin key is not a client key
    async with client.post(router.url + CHAT, data=b"{}", headers=_bearer(CLIENT_KEY)) as resp:
        assert resp.status == 200


async def test_admin_key_without_client_key_leaves_client_routes_open(
    make_worker, make_router, client
):
    worker = await make_worker()
    router = await make_router([worker.url], admin_api_key=ADMIN_KEY)
    async with client.post(router.url + CHAT, data=b"{}") as resp:
        assert resp.status == 200
    async with client.get(router.url + "/workers") as resp:
        assert resp.status == 401


async def test_enable_admin_api_serves_it_open_without_any_key(make_worker, make_router, client):
    worker = await make_worker()
    router = await make_router([worker.url], enable_admin_api=True)
    assert await _admin_calls(client, router, worker.url, {}) == [200, 200, 201, 200, 200]


@pytest.mark.parametrize("sent", [b"cl\xe9-key", b"cl\xc3\xa9-key"], ids=["latin-1", "utf-8"])
async def test_a_latin1_admin_key_is_accepted_in_either_byte_spelling(
    make_worker, make_router, sent
):
    worker = await make_worker()
    router = await make_router([worker.url], admin_api_key="cl\u00e9-key")
    request = (
        b"GET /workers HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer %s\r\n\r\n"
    )
    status, _, body = await raw_exchange(router.url, request % sent)
    assert status == 200 and worker.url.encode() in body
    status, _, _ = await raw_exchange(router.url, request % b"cl\xe9-kez")
    assert status == 401


async def test_worker_ids_accept_the_url_itself_and_the_encoded_id(
    make_worker, make_router, client
):
    a, b = await make_worker(), await make_worker()
    router = await make_router([a.url, b.url], admin_api_key=ADMIN_KEY)
    auth = _bearer(ADMIN_KEY)
    port = a.url.rsplit(":", 1)[1]
    # The URL as it is, the id (percent-encoded URL), and other spellings of the same URL.
    for form in (a.url, quote(a.url, safe=""), a.url + "/", f"HTTP://127.0.0.1:{port}/"):
        async with client.get(router.url + "/workers/" + form, headers=auth) as resp:
            assert resp.status == 200, form
            assert (await resp.json())["url"] == a.url
    async with client.put(
        router.url + "/workers/" + a.url, json={"disabled": True}, headers=auth
    ) as resp:
        assert resp.status == 200 and (await resp.json())["disabled"] is True
    encoded = "/workers/" + quote(a.url, safe="")
    async with client.put(router.url + encoded, json={"disabled": False}, headers=auth) as resp:
        assert resp.status == 200 and (await resp.json())["disabled"] is False
    async with client.delete(router.url + "/workers/" + a.url, headers=auth) as resp:
        assert resp.status == 200
    async with client.delete(
        router.url + "/workers/" + quote(b.url, safe=""), headers=auth
    ) as resp:
        assert resp.status == 200
    assert len(router.registry) == 0
    for missing in (a.url, "http://169.254.169.254", "not a url"):
        async with client.get(
            router.url + "/workers/" + quote(missing, safe=""), headers=auth
        ) as resp:
            assert (
                resp.status == 404
                and "GET /workers lists them" in (await resp.json())["error"]["message"]
            )


async def test_admin_body_over_the_cap_is_refused_from_its_content_length(make_router):
    router = await make_router([], wait_healthy=False, enable_admin_api=True)
    # A body announced at 10 MiB of which only a few bytes ever come: 413 without waiting for it.
    head = b"POST /workers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    status, headers, body = await raw_exchange(
        router.url, head % (10 << 20) + b'{"url": ', timeout=2.0
    )
    assert status == 413 and b"65536 bytes" in body
    assert headers["Connection"] == "close"
    status, _, _ = await raw_exchange(
        router.url, head % (MAX_ADMIN_BODY_BYTES + 1) + b"{", timeout=2.0
    )
    assert status == 413
    assert len(router.registry) == 0


async def test_chunked_admin_body_is_refused_after_the_cap_not_read_to_its_end(make_router):
    router = await make_router([], wait_healthy=False, enable_admin_api=True)
    chunk = b" " * 8192
    # 72 KiB of chunks and no final chunk: the body never ends, so only a capped read answers.
    request = b"POST /workers HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    request += b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(9))
    status, _, body = await raw_exchange(router.url, request, timeout=2.0)
    assert status == 413 and b"payload_too_large" in body


async def test_admin_body_of_exactly_the_cap_is_accepted(make_worker, make_router, client):
    worker = await make_worker()
    router = await make_router([], wait_healthy=False, enable_admin_api=True)
    body = b'{"url": "%s"}' % worker.url.encode()
    body += b" " * (MAX_ADMIN_BODY_BYTES - len(body))

    async def chunks():
        yield body[:1000]
        yield body[1000:]

    async with client.post(router.url + "/workers", data=body) as resp:
        assert resp.status == 201
    async with client.delete(router.url + "/workers/" + worker.url) as resp:
        assert resp.status == 200
    async with client.post(router.url + "/workers", data=chunks()) as resp:  # chunked, no length
        assert resp.status == 201


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"url": "http://127.0.0.1:1\xff"}', "not UTF-8"),
        (b"\xef\xbb\xbf\xff\xfe", "not UTF-8"),
        (b"", "not valid JSON"),
        (b"{url: 1}", "not valid JSON"),
        (b"[" * 60000, "nested too deeply"),
        (b'{"url": "gopher://127.0.0.1:1"}', "http:// or https://"),
        (b'{"url": "http://[fe80::1]:8000"}', "link-local"),
        (b'{"url": "http://127.0.0.1:1/' + b"p" * 3000 + b'"}', "the limit is 2048"),
        (b'{"url": "http://127.0.0.1:1", "model": "' + b"m" * 300 + b'"}', "model: 300 characters"),
        (
            b'{"url": "http://127.0.0.1:1", "capabilities": '
            + b"["
            + b'"chat", ' * 20
            + b'"chat"]}',
            "at most 9",
        ),
        (b'{"url": "http://127.0.0.1:1", "model": 5}', "model"),
    ],
)
async def test_bad_admin_bodies_get_400_naming_the_problem(make_router, client, body, message):
    router = await make_router([], wait_healthy=False, enable_admin_api=True)
    async with client.post(router.url + "/workers", data=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert message in error["message"] and error["type"] == "invalid_request"
    assert len(error["message"]) < 400  # long input is cut, not echoed whole
    assert len(router.registry) == 0


async def test_put_validates_its_body_like_post(make_worker, make_router, client):
    worker = await make_worker()
    router = await make_router([worker.url], enable_admin_api=True)
    path = router.url + "/workers/" + worker.url
    for body, message in (
        (b"\xff", "not UTF-8"),
        (b"[]", "non-empty JSON object"),
        (b'{"url": "http://127.0.0.1:2"}', "unknown fields"),
        (b'{"model": "' + b"m" * 300 + b'"}', "model: 300 characters"),
        (b'{"capabilities": ["chat", "chat", "chat", "chat", "chat", "chat", "chat", "chat", "chat", "chat"]}',
         "at most 9"),
    ):  # fmt: skip
        async with client.put(path, data=body) as resp:
            assert resp.status == 400, body
            assert message in (await resp.json())["error"]["message"], body
    state = router.registry.get(worker.url)
    assert state.model is None and state.capabilities is None
