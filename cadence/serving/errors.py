"""How a request's failure is told to its client, whatever the protocol.

One JSON error body (`{"error": {"message", "type", "param", "code"}}`) for every route,
and one decoder for JSON request bodies that turns every way a body can be wrong (not
JSON, not UTF-8, nested past any sense) into an `InvalidParameter` naming the problem.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from cadence.sampling_params import InvalidParameter

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# A 5xx caused by the request itself (the server survived it; retrying it elsewhere would
# fail the same way) carries this header (HTTP) or trailing metadata key (gRPC), value "request".
FAULT_HEADER = "x-cadence-fault"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": status}}


def decode_json(body: bytes | bytearray | memoryview | str, empty: Any = None) -> Any:
    """A request body's JSON value; `empty` for an empty body. Raises `InvalidParameter`."""
    if not len(body):
        return {} if empty is None else empty
    try:
        return msgspec.json.decode(body)
    except UnicodeDecodeError as e:
        raise InvalidParameter(None, f"the request body is not valid UTF-8 (byte {e.start}: {e.reason}); "
                                     "send JSON encoded as UTF-8") from None
    except msgspec.DecodeError as e:
        raise InvalidParameter(None, f"the request body is not valid JSON: {e}") from None


def readable(error: msgspec.ValidationError) -> InvalidParameter:
    """msgspec's "Expected `int`, got `str` - at `$.top_logprobs_num[1]`" as an
    InvalidParameter naming the field: "top_logprobs_num[1] has the wrong type: ..."."""
    text = str(error)
    match = re.search(r" - at `\$\.([A-Za-z_]\w*)(.*)`$", text)
    if match is None:
        return InvalidParameter(None, text)
    field, rest = match.group(1), match.group(2)
    problem = text[: match.start()].replace("`", "")
    return InvalidParameter(field, f"{field}{rest} has the wrong type: {problem[:1].lower()}{problem[1:]}")
