"""The one family of errors a request can end with, below every process and protocol.

Every error carries the HTTP status it answers with; `cadence.serving.errors` holds the one
table that maps a status to its HTTP error type and its gRPC status code, so both protocols
fail alike. Imports nothing of Cadence.
"""

from __future__ import annotations

import re

import msgspec


class CadenceError(Exception):
    """A request the server will not or cannot serve; `status` is its HTTP status."""

    status = 500

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault, if one is (OpenAI's `error.param`)


class InvalidParameter(CadenceError, ValueError):
    """A value given by the user is wrong (400). `param` names the field at fault, the
    top-level name (e.g. "stop" for a bad `stop[2]`); None when no single field is to blame
    (e.g. the body is not a JSON object)."""

    status = 400

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message, param)


class RequestError(CadenceError):
    """Any other refusal or failure, with its status: 404 unknown model, 429 overloaded,
    503 starting or stopping, 500 internal, ...

    `is_request_fault` marks an internal error (5xx) caused by the request itself, which the
    server survived: retrying it elsewhere would fail the same way."""

    def __init__(
        self, status: int, message: str, param: str | None = None, is_request_fault: bool = False
    ):
        super().__init__(message, param)
        self.status = status
        self.is_request_fault = is_request_fault


def readable(error: msgspec.ValidationError) -> InvalidParameter:
    """msgspec's "Expected `int`, got `str` - at `$.top_logprobs_num[1]`" as an
    InvalidParameter naming the field: "top_logprobs_num[1] has the wrong type: ..."."""
    text = str(error)
    match = re.search(r" - at `\$\.([A-Za-z_]\w*)(.*)`$", text)
    if match is None:
        return InvalidParameter(None, text)
    field, rest = match.group(1), match.group(2)
    problem = text[: match.start()].replace("`", "")
    return InvalidParameter(
        field, f"{field}{rest} has the wrong type: {problem[:1].lower()}{problem[1:]}"
    )
