"""JSON error bodies of the HTTP contract: {"error": {"message", "type", "code", "param"}}."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from cadence.serving.errors import FAULT_HEADER, error_body

# Seconds a client told 429 (overloaded) should wait before trying again.
RETRY_AFTER_S = 1


def error_response(status: int, message: str, param: str | None = None, is_request_fault: bool = False) -> Response:
    headers = {}
    if status == 429:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if is_request_fault:
        headers[FAULT_HEADER] = "request"
    return Response(msgspec.json.encode(error_body(status, message, param)), status_code=status,
                    media_type="application/json", headers=headers)


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")
