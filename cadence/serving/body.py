"""The one reader of request bodies, for every HTTP route and the gRPC pass-through RPCs.

A raw body (JSON bytes, or the JSON string a gRPC message carries) is decoded by
`serving.errors.decode_json`, which bounds nesting and integers; then `parse_struct`
turns the decoded object into a typed request struct. Everything a body can get wrong is an
`InvalidParameter` naming the field at fault, in the same words whichever route it came
to: not an object, a required field missing, a field of the wrong type. Fields this server
does not implement are accepted and ignored, as OpenAI, SGLang and vLLM do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from cadence.errors import InvalidParameter, readable
from cadence.serving.errors import decode_json

logger = logging.getLogger(__name__)

_logged_unknown: set[tuple[str, str]] = set()


def json_object(value: Any) -> dict:
    """`value` (a decoded body) when it is a JSON object; else the 400 that says what it is."""
    if not isinstance(value, dict):
        raise InvalidParameter(
            None, f"the request body must be a JSON object, got {_json_kind(value)}"
        )
    return value


def parse_struct(cls: type, value: Any, required: Mapping[str, str] | None = None) -> Any:
    """A decoded body as a `cls` struct: each of `required` (field -> the error when it is
    missing or null) must be given, the other fields `cls` has are type-checked, the rest
    ignored. Fields a struct derives itself (its `_DERIVED`) cannot be given."""
    fields = json_object(value)
    derived = getattr(cls, "_DERIVED", ())
    fields = drop_unknown(fields, {f for f in cls.__struct_fields__ if f not in derived}, cls)
    for name, message in (required or {}).items():
        if fields.get(name) is None:
            raise InvalidParameter(name, message)
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as e:
        raise readable(e) from None


def parse_body(cls: type, body: bytes | bytearray | memoryview | str | dict, required=None) -> Any:
    """A raw body (or an object already decoded from one) as a `cls` struct."""
    value = body if isinstance(body, dict) else decode_json(body)
    return parse_struct(cls, value, required)


def drop_unknown(body: dict, known: Any, cls: type) -> dict:
    """`body` without the fields `cls` does not have (each name logged once, at debug
    level)."""
    unknown = [key for key in body if key not in known]
    if not unknown:
        return body
    for key in unknown:
        if (cls.__name__, str(key)) not in _logged_unknown:
            _logged_unknown.add((cls.__name__, str(key)))
            logger.debug(
                "%s: ignoring the field %r, which this server does not implement",
                cls.__name__,
                key,
            )
    return {key: value for key, value in body.items() if key in known}


def _json_kind(value: Any) -> str:
    return {
        list: "an array",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), type(value).__name__)
