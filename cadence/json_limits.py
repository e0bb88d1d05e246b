"""How deeply a client's JSON may nest and how large its integers may be, checked before
anything recurses over it or packs it into a message.

Decoders, chat templates, grammar compilers and schema walkers all recurse once per level
of nesting; a 2 KB body nested a thousand levels deep would exhaust the interpreter's stack
somewhere below the edge and turn one request into an internal error. Every JSON text a
client sends (a request body, a `json_schema` string, a tool call's `arguments`) is measured
here first, so such a request is a 400 naming the field. Imports nothing of Cadence.

The measure is cheap where it matters: a text with no more brackets than the limit cannot
nest deeper than it, which is every ordinary request; only the rest are scanned, in C
(a regular expression that skips strings), never by recursion.

Integers: every number a request carries ends up in a signed 64-bit field (a msgpack
message, a tensor, a protobuf), and JSON has no bound of its own, so an integer outside
int64 anywhere in a body is refused at the edge, naming the field, before any code past the
decoder can trip over it. Bodies without a run of 19 digits are never walked.
"""

from __future__ import annotations

import re

# Levels of arrays and objects a JSON text may nest. OpenAI's structured outputs serve
# schemas of at most 10 levels (about 25 JSON levels inside a chat request); 64 leaves room
# for deep tool schemas while every recursive consumer stays far from Python's stack limit.
MAX_JSON_DEPTH = 64

# A JSON string (escapes included) or one bracket; strings are matched whole so that the
# brackets inside them are not counted.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_OPENERS = (ord("["), ord("{"))
_LONG_DIGITS = re.compile(rb"\d{19}")  # int64 has 19 digits: shorter runs always fit
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class TooDeep(ValueError):
    """A JSON text nests deeper than the limit."""

    def __init__(self, limit: int, key: str | None):
        self.limit = limit
        self.key = key  # the top-level object key whose value is too deep, if there is one
        super().__init__(
            f"it nests arrays and objects more than {limit} levels deep; "
            f"at most {limit} levels are accepted"
        )


def check_depth(text: bytes | bytearray | memoryview | str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raises `TooDeep` when `text` (JSON, not yet decoded) nests deeper than `limit`."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    depth = 0
    key = None  # the last string seen at depth 1: the key of the value being read there
    for match in _TOKEN.finditer(data):
        first = match.group()[0]
        if first == 0x22:  # a string
            if depth == 1:
                key = match.group()
            continue
        if first in _OPENERS:
            depth += 1
            if depth > limit:
                raise TooDeep(limit, _key_text(key) if data.lstrip()[:1] == b"{" else None)
        else:
            depth -= 1
            if depth == 1:
                key = None


def _key_text(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        return raw[1:-1].decode()
    except UnicodeDecodeError:
        return None


class IntegerTooLarge(ValueError):
    """A decoded JSON value holds an integer outside int64."""

    def __init__(self, value: int, path: str):
        self.path = path  # where it is, e.g. "sampling_params.seed" or "input_ids[3]"
        # the innermost object key holding it (what a field check would name), if any
        self.key = next((p for p in reversed(re.split(r"[.\[]", path)) if p and p[-1] != "]"), None)
        shown = str(value) if len(str(value)) <= 40 else f"{str(value)[:37]}..."
        super().__init__(
            f"{path or 'the request body'} holds the integer {shown}, which does not fit in a "
            f"signed 64-bit integer [{INT64_MIN}, {INT64_MAX}]"
        )


def check_integers(raw: bytes | bytearray | memoryview | str, value: object) -> None:
    """Raises `IntegerTooLarge` when `value` (decoded from `raw`) holds an integer outside
    int64. Walks `value` (iteratively) only when `raw` has 19 digits in a row somewhere."""
    data = raw.encode() if isinstance(raw, str) else raw
    if _LONG_DIGITS.search(data) is None:
        return
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if type(v) is int:
            if not INT64_MIN <= v <= INT64_MAX:
                raise IntegerTooLarge(v, path)
        elif isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), item) for k, item in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
