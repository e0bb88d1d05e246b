"""Every error the router makes itself is a JSON body, aiohttp's own and unexpected ones included."""

from __future__ import annotations

import logging

from router_fakes import assert_idle

CHAT = "/v1/chat/completions"


async def _json_error(resp) -> dict:
    assert resp.content_type == "application/json", await resp.text()
    error = (await resp.json())["error"]
    assert error["code"] == resp.status
    assert resp.headers["x-cadence-request-id"]
    return error


async def test_unknown_route_and_wrong_method_are_json(make_router, client):
    router = await make_router([], wait_healthy=False)
    async with client.get(router.url + "/v1/nothing-here") as resp:
        assert resp.status == 404
        error = await _json_error(resp)
        assert error["type"] == "not_found" and "/v1/nothing-here" in error["message"]
    async with client.get(router.url + CHAT) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
        assert "allowed: POST" in (await _json_error(resp))["message"]
    async with client.get(router.url + "/workers/") as resp:  # an empty id is no route
        assert resp.status == 404
        await _json_error(resp)


async def test_unexpected_exception_is_a_logged_json_500(make_worker, make_router, client, caplog):
    worker = await make_worker()
    router = await make_router([worker.url], enable_admin_api=True)

    async def broken_forward(request, body, ex):
        raise RuntimeError("bug in the forwarder")

    def broken_update(worker, changes):
        raise KeyError("bug in the registry")

    router.forwarder.forward = broken_forward
    router.update_worker = broken_update
    with caplog.at_level(logging.ERROR, logger="cadence.router"):
        async with client.post(
            router.url + CHAT, data=b"{}", headers={"x-request-id": "rid-1"}
        ) as resp:
            assert resp.status == 500
            error = await _json_error(resp)
            assert resp.headers["x-cadence-request-id"] == "rid-1" and "rid-1" in error["message"]
            assert "bug" not in error["message"]  # internals stay in the log
        async with client.put(
            router.url + "/workers/" + worker.url, json={"disabled": True}
        ) as resp:
            assert resp.status == 500
            await _json_error(resp)
    logged = [r for r in caplog.records if r.exc_info]
    assert [type(r.exc_info[1]) for r in logged] == [RuntimeError, KeyError]
    assert "rid-1" in logged[0].getMessage()
    await assert_idle(router)
    async with client.get(router.url + "/live") as resp:
        assert resp.status == 200  # the router goes on serving
