"""Fake prefill and decode servers on real loopback sockets for the PD router tests.

A `FakePdServer` records every generate request's JSON body, answers as its knobs say
(JSON, an event stream, a status, or never), serves GET /server_info with its
disaggregation mode and bootstrap port, and notes when the router closed a connection
it was still answering on (aiohttp cancels the handler then). The fixtures start such
servers and PD routers in front of them, with probes fast enough for tests.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from router_fakes import wait_for

from cadence.router.config import RouterConfig, load_worker_specs
from cadence.router.server import Router


@dataclass
class FakePdServer:
    role: str  # prefill | decode (what /server_info reports as disaggregation_mode)
    mode: str = "json"  # json | sse | hang | hang_after_headers | break_after_headers
    status: int = 200
    answer: object = field(default_factory=lambda: {"text": "ok"})
    events: list[bytes] = field(default_factory=list)
    event_gap_secs: float = 0.0
    delay_secs: float = 0.0
    bootstrap_port: int | None = None  # /server_info's disaggregation_bootstrap_port
    report_mode: bool = True  # /server_info carries disaggregation_mode
    health_status: int = 200
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    num_cancelled: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakePdServer:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/{tail:.*}", self._generate)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status, text="ok")

    async def _server_info(self, request: web.Request) -> web.Response:
        info: dict = {"version": "fake"}
        if self.report_mode:
            info["disaggregation_mode"] = self.role
        if self.bootstrap_port is not None:
            info["disaggregation_bootstrap_port"] = self.bootstrap_port
        return web.json_response(info)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(json.loads(await request.read()))
        self.headers.append(dict(request.headers))
        self.started.set()
        try:
            return await self._answer(request)
        except asyncio.CancelledError:
            self.num_cancelled += 1
            self.cancelled.set()  # the router closed the connection mid-answer
            raise

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if self.delay_secs:
            await asyncio.sleep(self.delay_secs)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode in ("sse", "hang_after_headers", "break_after_headers"):
            response = web.StreamResponse(
                status=self.status, headers={"Content-Type": "text/event-stream"}
            )
            await response.prepare(request)
            for event in self.events:
                await response.write(event)
                if self.event_gap_secs:
                    await asyncio.sleep(self.event_gap_secs)
            if self.mode == "hang_after_headers":
                await asyncio.sleep(3600)
            if self.mode == "break_after_headers":
                request.transport.close()  # the server dies mid-stream
                return response
            await response.write_eof()
            return response
        if isinstance(self.answer, bytes):
            return web.Response(status=self.status, body=self.answer)
        return web.json_response(self.answer, status=self.status, headers={"X-Side": self.role})


FAST = {
    "health_check_interval_secs": 0.05,
    "health_check_startup_interval_secs": 0.02,
    "health_check_timeout_secs": 1.0,
    "retry_initial_backoff_ms": 1.0,
    "retry_max_backoff_ms": 5.0,
    "enable_admin_api": True,
}


@pytest.fixture
async def make_server():
    servers: list[FakePdServer] = []

    async def make(role: str, **knobs) -> FakePdServer:
        server = await FakePdServer(role, **knobs).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


@pytest.fixture
async def make_pd_router():
    routers: list[Router] = []

    async def make(prefill, decode, wait_healthy: bool = True, **overrides) -> Router:
        config = RouterConfig(
            port=0,
            pd_disaggregation=True,
            prefill_urls=tuple((s.url, port) for s, port in prefill),
            decode_urls=tuple(s.url for s in decode),
            **{**FAST, **overrides},
        )
        router = Router(config, load_worker_specs(config))
        await router.start()
        routers.append(router)
        if wait_healthy:
            num = len(prefill) + len(decode)
            await wait_for(lambda: len(router.registry.routable) == num, what="workers healthy")
        return router

    yield make
    for router in routers:
        await router.stop()
