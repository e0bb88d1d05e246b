"""How failures become gRPC status codes (never messages inside a response).

The request logic below the adapters speaks HTTP statuses (`RequestError.status`) and
`InvalidParameter`; this module is the one table that turns them into gRPC codes, so the
two protocols fail alike: 400 -> INVALID_ARGUMENT, 429 -> RESOURCE_EXHAUSTED, and so on.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from cadence.sampling_params import InvalidParameter
from cadence.serving.errors import FAULT_HEADER
from cadence.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def code_for_http_status(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP error status (another 4xx: INVALID_ARGUMENT; 5xx: INTERNAL)."""
    if status in _CODES:
        return _CODES[status]
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= status < 500 else grpc.StatusCode.INTERNAL


class RpcError(Exception):
    """Ends the current call with `code` and `message` (raised by the servicer's own checks)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing_metadata: tuple = ()):
        super().__init__(message)
        self.code = code
        self.trailing_metadata = trailing_metadata


def _status_of(e: Exception) -> tuple[grpc.StatusCode, str, tuple] | None:
    if isinstance(e, RpcError):
        return e.code, str(e), e.trailing_metadata
    if isinstance(e, InvalidParameter):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e), ()
    if isinstance(e, RequestError):
        return code_for_http_status(e.status), str(e), ((FAULT_HEADER, "request"),) if e.is_request_fault else ()
    return None


async def _abort(context, e: Exception, method: str):
    status = _status_of(e)
    if status is None:
        logger.exception("gRPC %s failed", method)
        status = grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log", ()
    await context.abort(*status)


def rpc(method):
    """Wraps a servicer method (coroutine or async generator) so that its errors become
    statuses: ours mapped by the table, anything else INTERNAL and logged."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context, **kwargs):
            messages = method(self, request, context, **kwargs)
            try:
                async for msg in messages:
                    yield msg
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _abort(context, e, name)
            finally:
                await messages.aclose()  # now, not at garbage collection: it may hold a request
        return stream

    @functools.wraps(method)
    async def unary(self, request, context, **kwargs):
        try:
            return await method(self, request, context, **kwargs)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(context, e, name)
    return unary
