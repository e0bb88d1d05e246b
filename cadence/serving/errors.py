"""How a request's failure is told to its client, whatever the protocol.

The error family is `cadence.errors` (every error carries its HTTP status); this module is
the one table that turns a status into the HTTP error body's `type` and into a gRPC status
code (by name: this module does not import grpc), so both protocols fail alike. It also
holds the one decoder for JSON request bodies, which turns every way a body can be wrong
(not JSON, not UTF-8) into an `InvalidParameter` naming the problem.
"""

from __future__ import annotations

from typing import Any

import msgspec

from cadence.errors import InvalidParameter

# HTTP status -> (the JSON error body's `type`, the gRPC status code's name)
STATUSES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "INVALID_ARGUMENT"),
    401: ("authentication_error", "UNAUTHENTICATED"),
    403: ("permission_error", "PERMISSION_DENIED"),
    404: ("not_found_error", "NOT_FOUND"),
    408: ("timeout_error", "DEADLINE_EXCEEDED"),
    409: ("conflict_error", "FAILED_PRECONDITION"),
    413: ("request_too_large", "RESOURCE_EXHAUSTED"),
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
        return msgspec.json.decode(body)
    except UnicodeDecodeError as e:
        raise InvalidParameter(
            None,
            f"the request body is not valid UTF-8 (byte {e.start}: {e.reason}); "
            "send JSON encoded as UTF-8",
        ) from None
    except msgspec.DecodeError as e:
        raise InvalidParameter(None, f"the request body is not valid JSON: {e}") from None
