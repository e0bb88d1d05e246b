"""The HTTP adapter: the app, its gate, and every route over one `EngineClient`.

Thin by design: parse the body, build the request struct, call the engine client, turn its
results (or its errors) into responses. Validation lives below, shared with gRPC. The
routes are registered by area: `native_routes` (SGLang's own), `openai_routes`,
`embedding_routes`, `speech_routes`.
"""

from __future__ import annotations

import hmac
import logging
import os

import msgspec
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from cadence.entrypoints import openapi
from cadence.entrypoints.embedding_routes import register_embedding_routes
from cadence.entrypoints.http_io import BodyTooLarge, ClientGone, error_of, error_response
from cadence.entrypoints.native_routes import register_native_routes
from cadence.entrypoints.openai_routes import register_invocations, register_openai_routes
from cadence.entrypoints.speech_routes import register_speech_routes
from cadence.errors import CadenceError, InvalidParameter, RequestError
from cadence.front import metrics
from cadence.serving import native_api
from cadence.serving.bundle import serving_of
from cadence.serving.errors import FAULT_HEADER, decode_json_async, error_body, request_fault
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
            body = await decode_json_async(b"".join(chunks))
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
        if path != "/metrics":  # a scrape is answered even while stopping
            try:
                state.check_ready(while_loading=path in self.OPEN_WHILE_LOADING)
            except RequestError as e:
                return error_of(e)
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

    @app.exception_handler(ClientGone)
    async def _client_gone(request, e: ClientGone):
        # nginx's 499: nobody reads it; the request was aborted, nothing to log
        return Response(status_code=499)

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
    bundle = serving_of(state)  # the same objects the gRPC servicers answer through
    register_native_routes(app, state)
    register_openai_routes(app, bundle)
    register_embedding_routes(app, state, bundle)
    register_invocations(app, bundle)
    register_speech_routes(app, state, bundle)
    openapi.install(app)
    return app
