"""The HTTP adapter: SGLang's native routes over one `EngineClient`.

Thin by design: parse the body, build the request struct, call the engine client, turn its
results (or its errors) into responses. Validation lives below, shared with gRPC.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time

import msgspec
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import PlainTextResponse, Response

from cadence.entrypoints import openapi
from cadence.entrypoints.embedding_routes import register_embedding_routes
from cadence.entrypoints.http_io import (
    BodyTooLarge,
    error_of,
    error_response,
    json_response,
    read_json,
    stream_response,
    until_disconnected,
)
from cadence.entrypoints.openai_routes import register_invocations, register_openai_routes
from cadence.entrypoints.speech_routes import register_speech_routes
from cadence.errors import CadenceError, InvalidParameter
from cadence.front import metrics
from cadence.io_struct import (
    CloseSessionReqInput,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    GetLoadReqInput,
    OpenSessionReqInput,
    PauseGenerationReqInput,
    ProfileReq,
    UpdateWeightFromDiskReqInput,
)
from cadence.serving import control, embedding_serving, native_api
from cadence.serving.errors import FAULT_HEADER, decode_json, error_body, request_fault
from cadence.serving.state import ServerState
from cadence.version import __version__

logger = logging.getLogger(__name__)

OPEN_ROUTES = {"/health", "/health_generate"}


class Gate:
    """API key, readiness and body-size checks in front of every route, as a plain ASGI
    middleware.

    Starlette's `@app.middleware("http")` runs each request through extra tasks and memory
    streams: several times the cost of a small route such as /tokenize. This passes the
    request straight through (and leaves the receive channel, which carries disconnects,
    untouched, except that a body without a Content-Length is counted as it arrives)."""

    OPEN_WHILE_LOADING = frozenset({"/health", "/metrics", "/server_info", "/get_server_info"})

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        key = state.args.api_key
        self._expected_auth = f"Bearer {key}".encode("latin-1") if key else None
        self.max_body = state.args.max_request_body_bytes
        # With several front processes, every response names the one that answered.
        self._pid_header = (
            (b"x-cadence-front-pid", str(os.getpid()).encode())
            if state.args.api_workers > 1
            else None
        )

    # Small front-process routes answered here without the framework's routing and request
    # objects, which cost more than the work itself (the tokenizer takes microseconds).
    FAST_ROUTES = {
        "/tokenize": native_api.tokenize_body,
        "/v1/tokenize": native_api.tokenize_body,
        "/detokenize": native_api.detokenize_body,
        "/v1/detokenize": native_api.detokenize_body,
    }

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            send = self._counted_send(send)
            rejection = self._check(scope)
            if rejection is not None:
                return await rejection(scope, receive, send)
            length = _content_length(scope)
            if length is None:
                receive = self._counted(receive)
            handler = self.FAST_ROUTES.get(scope["path"])
            if handler is not None and scope["method"] == "POST":
                return await self._answer(handler, receive, send)
        await self.app(scope, receive, send)

    def _counted_send(self, send):
        """`send` that counts the response by status for /metrics (and adds the pid header)."""
        header = self._pid_header

        async def counted_send(message):
            if message["type"] == "http.response.start":
                metrics.record_response("http", message["status"])
                if header is not None:
                    message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        return counted_send

    def _counted(self, receive):
        """`receive` for a body of unknown length: raises BodyTooLarge once it is too long."""
        received = 0
        limit = self.max_body

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
            return message

        return counted

    async def _answer(self, handler, receive, send) -> None:
        chunks = []
        status = 200
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            body = decode_json(b"".join(chunks))
            out = msgspec.json.encode(await handler(self.state, body))
        except BodyTooLarge as e:
            status, out = 413, msgspec.json.encode(error_body(413, str(e)))
        except InvalidParameter as e:
            status, out = 400, msgspec.json.encode(error_body(400, str(e), e.param))
        except Exception as e:  # same contract as the routes: a marked JSON 500, logged
            logger.exception("%s failed", handler.__name__)
            fault = request_fault(handler.__name__, e)
            status, out = 500, msgspec.json.encode(error_body(500, str(fault)))
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(out)).encode()),
        ]
        if status >= 500:
            headers.append((FAULT_HEADER.encode(), b"request"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    def _check(self, scope) -> Response | None:
        path, state = scope["path"], self.state
        if self._expected_auth is not None and path not in OPEN_ROUTES:
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(auth, self._expected_auth):
                return error_response(
                    401, "missing or wrong API key: send `Authorization: Bearer <key>`"
                )
        if state.is_shutting_down and path != "/metrics":
            return error_response(503, "the server is shutting down")
        if path not in self.OPEN_WHILE_LOADING and not state.is_ready:
            return error_response(503, "the server is starting: the model is loading")
        length = _content_length(scope)
        if length is not None and length > self.max_body:
            return error_response(
                413,
                f"the request body has {length} bytes; this server takes at most "
                f"{self.max_body} (--max-request-body-mb)",
            )
        if length == -1:
            return error_response(400, "the Content-Length header is not a number")
        return None


def _content_length(scope) -> int | None:
    """The request's Content-Length; None when absent, -1 when it is not a number."""
    for key, value in scope["headers"]:
        if key == b"content-length":
            return int(value) if value.isdigit() else -1
    return None


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Cadence", version=__version__, docs_url=None, redoc_url=None)
    app.state.cadence = state

    @app.exception_handler(CadenceError)
    async def _cadence_error(request, e: CadenceError):
        return error_of(e)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request, e: BodyTooLarge):
        return error_response(413, str(e))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        # Every error a client sees is the JSON body, never plain text. Logged with its
        # traceback by the server (Starlette re-raises after answering). The server survived
        # it, so it is this request's own failure (serving.errors.request_fault).
        return error_of(request_fault(f"serving {request.url.path}", e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        message = (
            f"no route {request.method} {request.url.path}"
            if e.status_code in (404, 405)
            else str(e.detail)
        )
        return error_response(e.status_code, message)

    app.add_middleware(Gate, state=state)
    register_native_routes(app, state)
    openai = register_openai_routes(app, state)
    state.chat_template = openai.chat_template
    embeddings = register_embedding_routes(app, state, openai)
    register_invocations(app, openai, embeddings)
    register_speech_routes(app, state)
    openapi.install(app)
    return app


def register_native_routes(app: FastAPI, state: ServerState) -> None:
    def client():
        return state.client

    @app.get("/health")
    async def health():
        if not state.is_ready or state.is_shutting_down:
            return error_response(
                503, "starting" if not state.is_shutting_down else "shutting down"
            )
        if state.pipeline_problem is not None:
            return error_response(503, state.pipeline_problem)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        await asyncio.wait_for(embedding_serving.probe(client()), 30)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(
            await native_api.metrics_body(state), media_type="text/plain; version=0.0.4"
        )

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return json_response(native_api.model_info(client().info))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return json_response(await native_api.server_info(state))

    @app.get("/get_load")
    async def get_load():
        load = await client().control(GetLoadReqInput())
        return json_response(
            [
                {
                    "dp_rank": load.dp_rank,
                    "num_reqs": load.num_running_reqs,
                    "num_waiting_reqs": load.num_waiting_reqs,
                    "num_tokens": load.num_used_tokens,
                }
            ]
        )

    @app.get("/v1/loads")
    async def loads(request: Request):
        rank = native_api.check_dp_rank(request.query_params.get("dp_rank"))
        load = await client().control(GetLoadReqInput())
        entries = native_api.load_entries(load, rank)
        if request.query_params.get("format") == "prometheus":
            lines = []
            for e in entries:
                for name, value in e.items():
                    if name != "dp_rank":
                        lines.append(f'cadence_{name}{{dp_rank="{e["dp_rank"]}"}} {float(value)}')
            return PlainTextResponse(
                "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4"
            )
        return json_response({"timestamp": time.time(), "version": __version__, "loads": entries})

    @app.post("/generate")
    async def generate(request: Request):
        obj = native_api.generate_input(await read_json(request))
        gen = client().generate(obj)
        if obj.stream:
            if not state.args.incremental_streaming_output:
                gen = native_api.cumulative(gen)
            return await stream_response(gen)
        return json_response(await until_disconnected(request, native_api.last_result(gen)))

    # Also answered by `Gate` before routing (the hot path); these serve the same code to
    # anything that mounts the app without the middleware.
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        return json_response(await native_api.tokenize_body(state, await read_json(request)))

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        return json_response(await native_api.detokenize_body(state, await read_json(request)))

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = control.parse(control.AbortBody, await read_json(request))
        client().abort(body.rid, body.abort_all, "aborted by /abort_request")
        return Response(status_code=200)

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        decode_json(await request.body())  # any JSON body is accepted and ignored
        out = await client().control(FlushCacheReqInput())
        if not out.success:
            return error_response(400, f"cannot flush the cache: {out.message}")
        return PlainTextResponse("Cache flushed.\n")

    @app.api_route("/open_session", methods=["GET", "POST"])
    async def open_session(request: Request):
        body = control.parse(control.OpenSessionBody, await read_json(request))
        out = await client().control(
            OpenSessionReqInput(
                capacity_of_str_len=body.capacity_of_str_len,
                session_id=body.session_id,
                streaming=body.streaming,
                timeout=body.timeout,
            )
        )
        if not out.success:
            return error_response(400, f"cannot open the session: {out.message}")
        return json_response(out.session_id)

    @app.api_route("/close_session", methods=["GET", "POST"])
    async def close_session(request: Request):
        body = control.parse(control.CloseSessionBody, await read_json(request))
        await client().control(CloseSessionReqInput(session_id=body.session_id))
        return Response(status_code=200)  # closing an unknown session is not an error (SGLang)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = control.parse(control.PauseBody, await read_json(request))
        await client().control(PauseGenerationReqInput(mode=body.mode))
        return json_response({"success": True, "mode": body.mode})

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        decode_json(await request.body())  # any JSON body is accepted and ignored
        await client().control(ContinueGenerationReqInput())
        return json_response({"success": True})

    @app.post("/start_profile")
    async def start_profile(request: Request):
        body = control.parse(control.ProfileBody, await read_json(request))
        out = await client().control(
            ProfileReq(
                action="start",
                output_dir=body.output_dir,
                num_steps=body.num_steps,
                start_step=body.start_step,
            )
        )
        return json_response(
            {"success": out.success, "message": out.message}, 200 if out.success else 400
        )

    @app.post("/stop_profile")
    async def stop_profile(request: Request):
        decode_json(await request.body())  # any JSON body is accepted and ignored
        out = await client().control(ProfileReq(action="stop"))
        return json_response(
            {"success": out.success, "message": out.message}, 200 if out.success else 400
        )

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request):
        body = control.parse(control.UpdateWeightsBody, await read_json(request))
        out = await client().control(
            UpdateWeightFromDiskReqInput(model_path=body.model_path, load_format=body.load_format),
            timeout=900,
        )
        return json_response(
            {"success": out.success, "message": out.message}, 200 if out.success else 400
        )
