"""How a request's failure is told to its client, whatever the protocol.

The error family is `cadence.errors` (every error carries its HTTP status); this module is
the one table that turns a status into the HTTP error body's `type` and into a gRPC status
code (by name: this module does not import grpc), so both protocols fail alike. It also
holds the one decoder for JSON request bodies, which turns every way a body can be wrong
(not JSON, not UTF-8, nested too deep) into an `InvalidParameter` naming the problem, and
the one constructor of the internal error a request's own failure ends with.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from cadence.errors import InvalidParameter, RequestError
from cadence.front import metrics
from cadence.json_limits import IntegerTooLarge, TooDeep, check_depth, check_integers

# HTTP status -> (the JSON error body's `type`, the gRPC status code's name)
STATUSES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "INVALID_ARGUMENT"),
    401: ("authentication_error", "UNAUTHENTICATED"),
    403: ("permission_error", "PERMISSION_DENIED"),
    404: ("not_found_error", "NOT_FOUND"),
    408: ("timeout_error", "DEADLINE_EXCEEDED"),
    409: ("conflict_error", "FAILED_PRECONDITION"),
    413: ("request_too_large", "RESOURCE_EXHAUSTED"),
    416: ("out_of_range_error", "OUT_OF_RANGE"),
    422: ("invalid_request_error", "INVALID_ARGUMENT"),
    429: ("rate_limit_error", "RESOURCE_EXHAUSTED"),
    499: ("cancelled", "CANCELLED"),
    500: ("internal_error", "INTERNAL"),
    501: ("not_implemented_error", "UNIMPLEMENTED"),
    503: ("service_unavailable", "UNAVAILABLE"),
    504: ("timeout_error", "DEADLINE_EXCEEDED"),
}

# A 5xx caused by the request itself (the server survived it; retrying it elsewhere would
# fail the same way) carries this header (HTTP) or trailing metadata key (gRPC), value "request".
FAULT_HEADER = "x-cadence-fault"


def grpc_code_name(status: int) -> str:
    """The gRPC code of an HTTP status (another 4xx: INVALID_ARGUMENT; 5xx: INTERNAL)."""
    if status in STATUSES:
        return STATUSES[status][1]
    return "INVALID_ARGUMENT" if 400 <= status < 500 else "INTERNAL"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = STATUSES[status][0] if status in STATUSES else "error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def decode_json(body: bytes | bytearray | memoryview | str, empty: Any = None) -> Any:
    """A request body's JSON value; `empty` ({} by default) for an empty body. Raises
    `InvalidParameter`."""
    if not len(body):
        return {} if empty is None else empty
    try:
        check_depth(body)
        value = msgspec.json.decode(body)
        check_integers(body, value)
        return value
    except TooDeep as e:
        where = f"the field {e.key!r}" if e.key is not None else "the request body"
        raise InvalidParameter(e.key, f"{where} is nested too deep: {e}") from None
    except IntegerTooLarge as e:
        raise InvalidParameter(e.key, str(e)) from None
    except RecursionError:  # a decoder deeper than the check (cannot happen below the limit)
        raise InvalidParameter(None, "the request body is nested too deep") from None
    except UnicodeDecodeError as e:
        raise InvalidParameter(
            None,
            f"the request body is not valid UTF-8 (byte {e.start}: {e.reason}); "
            "send JSON encoded as UTF-8",
        ) from None
    except msgspec.DecodeError as e:
        raise InvalidParameter(None, f"the request body is not valid JSON: {e}") from None


# Bodies larger than this are decoded on a worker thread: ~6 ms a megabyte of checks and
# decoding that the event loop would otherwise spend while every other client waits.
DECODE_OFF_LOOP_BYTES = 1 << 20


async def decode_json_async(body: bytes | bytearray | memoryview | str, empty: Any = None) -> Any:
    """`decode_json`, on a worker thread for a large body (the loop takes turns with it)."""
    if len(body) <= DECODE_OFF_LOOP_BYTES:
        return decode_json(body, empty)
    return await asyncio.to_thread(decode_json, body, empty)


def loads_bounded(text: str, field: str) -> Any:
    """A JSON value sent inside a string field (a `json_schema`, a tool call's `arguments`),
    decoded with the body's depth bound; raises `InvalidParameter` naming `field`."""
    try:
        check_depth(text)
        return msgspec.json.decode(text)
    except TooDeep as e:
        raise InvalidParameter(field, f"{field} is nested too deep: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise InvalidParameter(field, f"{field} is not valid JSON: {e}") from None


def request_fault(where: str, error: BaseException) -> RequestError:
    """The 500 a request ends with when serving it raised something unexpected: the server
    survived it and the next request is served, so the error is marked as the request's own
    (a router neither retries it elsewhere nor holds it against this server)."""
    metrics.record_fault("front")
    return RequestError(
        500,
        f"internal error while {where}: {type(error).__name__}; see the server log",
        is_request_fault=True,
    )
