"""JSON error bodies of the HTTP contract: {"error": {"message", "type", "code", "param"}}."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> Response:
    return Response(msgspec.json.encode(error_body(status, message, param)), status_code=status,
                    media_type="application/json")


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")
