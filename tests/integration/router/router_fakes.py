"""Real upstream HTTP servers on loopback for the router tests, and small helpers.

A `FakeWorker` is a small aiohttp app on a real socket whose behaviour each test sets:
answer JSON, answer a given status, stream SSE events, hang, or break mid-stream. It
records what it received and when a stream it was writing got closed by its peer.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from cadence.router.server import Router


@dataclass
class Received:
    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeWorker:
    """Behaviour knobs (set by tests) and what was received."""

    mode: str = "json"  # json | status | echo | sse | hang | break | slow
    status: int = 200
    body: bytes = b'{"ok": true}'
    content_type: str = "application/json"
    extra_headers: dict[str, str] = field(default_factory=dict)
    events: list[bytes] = field(default_factory=list)
    event_gap_secs: float = 0.0
    delay_secs: float = 0.0
    health_status: int = 200
    models: list[dict] | None = None
    capabilities: list[str] | None = None  # GET /capabilities; None: 404, as an older worker
    received: list[Received] = field(default_factory=list)
    num_health_probes: int = 0
    num_events_written: int = 0
    stream_closed: asyncio.Event = field(default_factory=asyncio.Event)
    handler_started: asyncio.Event = field(default_factory=asyncio.Event)
    host: str = "127.0.0.1"  # any loopback address (pods of one port differ by address)
    port: int = 0  # 0: a free port
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeWorker:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/capabilities", self._capabilities)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def num_requests(self) -> int:
        return len(self.received)

    async def _health(self, request: web.Request) -> web.Response:
        self.num_health_probes += 1
        return web.Response(status=self.health_status, text="ok")

    async def _capabilities(self, request: web.Request) -> web.Response:
        if self.capabilities is None:
            return web.Response(status=404, text="no route")
        return web.json_response({"capabilities": self.capabilities})

    async def _models(self, request: web.Request) -> web.Response:
        if self.models is None:
            return web.Response(status=500, text="no models")
        return web.json_response({"object": "list", "data": self.models})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            Received(request.method, request.raw_path, dict(request.headers), body)
        )
        self.handler_started.set()
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "slow":
            await asyncio.sleep(self.delay_secs)
        if self.mode in ("sse", "break"):
            return await self._stream(request)
        if self.mode == "echo":  # answer with the very bytes received
            return web.Response(
                status=self.status, body=body, headers={"Content-Type": "application/octet-stream"}
            )
        headers = {"Content-Type": self.content_type, **self.extra_headers}
        return web.Response(status=self.status, body=self.body, headers=headers)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            status=self.status, headers={"Content-Type": "text/event-stream", **self.extra_headers}
        )
        await response.prepare(request)
        try:
            for i, event in enumerate(self.events):
                if self.mode == "break" and i == len(self.events) // 2:
                    request.transport.close()  # die mid-stream
                    return response
                await response.write(event)
                self.num_events_written += 1
                if self.event_gap_secs:
                    await asyncio.sleep(self.event_gap_secs)
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.stream_closed.set()  # the router closed the upstream connection
            raise
        return response


async def raw_exchange(
    url: str, data: bytes, timeout: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    """Send `data` as it is on a fresh connection to `url`'s host; the answer's status, headers, body.

    For requests an HTTP client library would not send (raw header bytes, a body cut
    short). Returns once the answer's Content-Length is in, without waiting for the server
    to close (it may linger, reading the rest of a body we never send).
    """
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    received = bytearray()
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            while not _is_complete(received):
                try:
                    chunk = await reader.read(65536)
                except ConnectionResetError:  # closed with our unread bytes pending
                    break
                if not chunk:
                    break
                received += chunk
    finally:
        writer.close()
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def _is_complete(received: bytearray) -> bool:
    head, sep, body = bytes(received).partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False  # no length: read until the server closes


def closed_port_url() -> str:
    """A loopback URL on which nothing listens: connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def wait_for(
    predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
) -> None:
    """Poll `predicate` every 10 ms; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def assert_idle(router: Router) -> None:
    """Every count is released: in-flight requests and each worker's active count."""
    await wait_for(
        lambda: router.num_in_flight == 0 and all(w.active == 0 for w in router.registry),
        timeout=2.0,
        what="active counts back to zero",
    )
