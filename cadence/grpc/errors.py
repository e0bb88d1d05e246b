"""How failures become gRPC status codes (never messages inside a response).

Every error is one of `cadence.errors` (the servicer's own checks raise them too) and carries
an HTTP status; `cadence.serving.errors` maps that status to a gRPC code, the same table the
HTTP adapter's error types come from, so the two protocols fail alike: 400 ->
INVALID_ARGUMENT, 429 -> RESOURCE_EXHAUSTED, 503 -> UNAVAILABLE, and so on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc

from cadence.errors import CadenceError, RequestError
from cadence.front import metrics
from cadence.serving.errors import FAULT_HEADER, grpc_code_name, request_fault

logger = logging.getLogger(__name__)


def code_for_http_status(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP error status (another 4xx: INVALID_ARGUMENT; 5xx: INTERNAL)."""
    return grpc.StatusCode[grpc_code_name(status)]


class RpcError(RequestError):
    """A `RequestError` with trailing metadata for the client (e.g. the HTTP status and JSON
    error body of an OpenAI pass-through call)."""

    def __init__(self, status: int, message: str, trailing_metadata: tuple = ()):
        super().__init__(status, message)
        self.trailing_metadata = trailing_metadata

    @property
    def code(self) -> grpc.StatusCode:
        return code_for_http_status(self.status)


def _status_of(e: Exception) -> tuple[grpc.StatusCode, str, tuple] | None:
    if not isinstance(e, CadenceError):
        return None
    metadata = tuple(getattr(e, "trailing_metadata", ()))
    if getattr(e, "is_request_fault", False):
        metadata += ((FAULT_HEADER, "request"),)
    return code_for_http_status(e.status), str(e), metadata


def _final_status(e: Exception, method: str) -> tuple[grpc.StatusCode, str, tuple]:
    """The status a failed call ends with (an unexpected error is logged, INTERNAL)."""
    status = _status_of(e)
    if status is None:  # the server survived it: the call's own failure (request_fault)
        logger.exception("gRPC %s failed", method)
        status = _status_of(request_fault(method, e))
    return status


def rpc(method):
    """Wraps a servicer method (coroutine or async generator) so that its errors become
    statuses: ours mapped by the table, anything else INTERNAL and logged. Every call is
    counted by its final status for /metrics."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context, **kwargs):
            messages = method(self, request, context, **kwargs)
            code = "OK"
            try:
                async for msg in messages:
                    yield msg
            except grpc.aio.AbortError:
                code = _code_name(context)
                raise
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as e:
                status = _final_status(e, name)
                code = status[0].name
                await context.abort(*status)
            finally:
                metrics.record_response("grpc", code)
                await messages.aclose()  # now, not at garbage collection: it may hold a request

        return stream

    @functools.wraps(method)
    async def unary(self, request, context, **kwargs):
        code = "OK"
        try:
            return await method(self, request, context, **kwargs)
        except grpc.aio.AbortError:
            code = _code_name(context)
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as e:
            status = _final_status(e, name)
            code = status[0].name
            await context.abort(*status)
        finally:
            metrics.record_response("grpc", code)

    return unary


def _code_name(context) -> str:
    try:
        code = context.code()
    except Exception:
        code = None
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
