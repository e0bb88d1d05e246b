"""HTTP plumbing the routes share: JSON answers and error bodies, reading bodies, server-sent
events, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from cadence.errors import CadenceError, RequestError
from cadence.serving.errors import FAULT_HEADER, decode_json_async, error_body, request_fault

logger = logging.getLogger(__name__)

# Seconds a client told 429 (overloaded) should wait before trying again.
RETRY_AFTER_S = 1


class BodyTooLarge(Exception):
    """A request body grew past --max-request-body-mb while it was read (413)."""

    def __init__(self, limit: int):
        super().__init__(
            f"the request body is larger than {limit} bytes (--max-request-body-mb); send less"
        )


def error_headers(status: int, is_request_fault: bool = False) -> dict[str, str]:
    headers = {}
    if status == 429:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if is_request_fault:
        headers[FAULT_HEADER] = "request"
    return headers


def error_response(
    status: int, message: str, param: str | None = None, is_request_fault: bool = False
) -> Response:
    return Response(
        msgspec.json.encode(error_body(status, message, param)),
        status_code=status,
        media_type="application/json",
        headers=error_headers(status, is_request_fault),
    )


def error_of(e: CadenceError) -> Response:
    return error_response(
        e.status, str(e), e.param, isinstance(e, RequestError) and e.is_request_fault
    )


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


async def read_json(request: Request) -> Any:
    return await decode_json_async(await request.body())


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away. Call only after the body has been read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client went away before its answer was ready (its request was aborted): nothing
    is left to answer, and nothing went wrong on this side."""


async def until_disconnected(request: Request, coro):
    """Runs `coro`, cancelling it if the client goes away first (its request is then aborted).

    Waits on the ASGI receive channel itself: `request.is_disconnected()` polls it under an
    already-cancelled scope, which never reports the disconnect through the HTTP middleware."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone("client disconnected")


async def stream_response(gen: AsyncIterator) -> StreamingResponse:
    """SSE of the chunks of `gen`; errors before the first chunk are ordinary error responses."""
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        first = None

    async def body():
        try:
            if first is not None:
                yield sse(first)
            async for chunk in gen:
                yield sse(chunk)
        except CadenceError as e:
            yield sse(error_body(e.status, str(e), e.param))
        except Exception as e:  # headers are gone: the failure is told in-band, as above
            logger.exception("a stream failed")
            fault = request_fault("streaming the response", e)
            yield sse(error_body(fault.status, str(fault)))
        finally:
            await gen.aclose()  # aborts the request if the client left mid-stream
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
