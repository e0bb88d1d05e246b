"""A forgiving scanner for JSON that is still being written: where a value starts and ends,
without needing the text to be complete.

Tool calls stream while the model writes them, so their parsers must find a call's name and
the raw text of its arguments in a prefix of the JSON. Every function here takes the whole
text and a position and answers None where the text ends before the answer is known.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """End (one past the closing quote) of the JSON string starting at text[i] == '"'."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """End of the JSON value starting at text[i] (after whitespace), or None when the text
    stops before the value does. A number or literal at the very end counts as unfinished."""
    i = skip_ws(text, i)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n;":
        j += 1
    return j if j < len(text) else None


def object_fields(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The fields of the JSON object starting at text[i] (after whitespace) as
    {key: (value start, value end or None while unfinished)}, and the object's end (None
    while unfinished). Keys still being written are left out."""
    fields: dict[str, tuple[int, int | None]] = {}
    i = skip_ws(text, i)
    if i >= len(text) or text[i] != "{":
        return fields, None
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return fields, None
        if text[i] == "}":
            return fields, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return fields, None  # not JSON; the caller sees an unfinished object
        key_end = string_end(text, i)
        if key_end is None:
            return fields, None
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return fields, None
        i = skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return fields, None
        start = skip_ws(text, i + 1)
        if start >= len(text):
            return fields, None
        end = value_end(text, start)
        fields[key] = (start, end)
        if end is None:
            return fields, None
        i = end


def loads_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
