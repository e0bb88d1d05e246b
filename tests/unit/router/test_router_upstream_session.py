"""The router's pooled upstream session never reuses a connection its worker may be closing.

Workers (Cadence and SGLang servers, both on uvicorn) close a keep-alive connection after 5 s
idle. A pooled connection picked at that moment takes the request into a closed socket: a
502 "Can not write request body" that no retry saves when a role has one worker. So the
session reuses a connection only while it has been idle for less than the workers' window,
with room for a busy event loop.
"""

from __future__ import annotations

import asyncio

import uvicorn

from cadence.router.server import UPSTREAM_KEEPALIVE_S, make_client_session


def test_the_reuse_window_is_well_inside_the_workers_keep_alive():
    workers_keep_alive = uvicorn.Config(app=None).timeout_keep_alive
    assert workers_keep_alive - UPSTREAM_KEEPALIVE_S >= 1.5


async def _worker() -> tuple[asyncio.Server, list[int]]:
    """A keep-alive HTTP/1.1 worker that records which connection carried each request."""
    carried: list[int] = []
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        mine = connections
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                await reader.readexactly(length)
                carried.append(mine)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0), carried


async def test_a_connection_is_reused_when_fresh_and_never_after_the_window():
    server, carried = await _worker()
    port = server.sockets[0].getsockname()[1]
    session = make_client_session()
    try:

        async def post() -> None:
            async with session.post(f"http://127.0.0.1:{port}/generate", data=b"{}") as r:
                assert r.status == 200 and await r.read() == b"ok"

        await post()
        await asyncio.sleep(0.2)
        await post()  # fresh: the pooled connection carries it
        await asyncio.sleep(UPSTREAM_KEEPALIVE_S + 0.3)
        await post()  # idle past the window: a new connection
    finally:
        await session.close()
        server.close()
        await server.wait_closed()
    assert carried == [1, 1, 2]
