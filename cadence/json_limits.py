"""How deeply a client's JSON may nest and how large its integers may be, checked before
anything recurses over it or packs it into a message.

Decoders, chat templates, grammar compilers and schema walkers all recurse once per level
of nesting; a 2 KB body nested a thousand levels deep would exhaust the interpreter's stack
somewhere below the edge and turn one request into an internal error. Every JSON text a
client sends (a request body, a `json_schema` string, a tool call's `arguments`) is measured
here first, so such a request is a 400 naming the field. Imports nothing of Cadence.

The measure is cheap where it matters: a text with no more brackets than the limit cannot
nest deeper than it, which is every ordinary request. The rest are measured in C: strings
are cut out by a regular expression, the brackets left become +1/-1 steps, and the deepest
running sum is the depth (numpy). Only a text found too deep is read token by token, within
its first MiB, to name the top-level field at fault.

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

# int64 has 19 digits: shorter runs always fit. Digits map to "0", all else to " ", and the
# search for 19 zeros is a plain substring search: ~5x faster than a regex over megabytes.
_DIGITS_AS_ZEROS = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))
_LONG_RUN = b"0" * 19
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
    _Structure(data).check_depth(limit)


class _Structure:
    """A JSON text's brackets and quotes as numpy arrays, strings told apart without reading
    the text in Python: escaped backslashes and escaped quotes are blanked first (pairs of
    backslashes, left to right, then a backslash before a quote), so every quote left opens
    or closes a string, and a byte lies inside a string when an odd number of quotes come
    before it. Linear in the text, a few passes in C."""

    def __init__(self, data: bytes):
        import numpy as np

        self.np = np
        self.data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
        self.bytes = np.frombuffer(self.data, dtype=np.uint8)
        self.quotes = np.flatnonzero(self.bytes == ord('"'))

    def outside_strings(self, positions):
        return positions[self.np.searchsorted(self.quotes, positions) % 2 == 0]

    def check_depth(self, limit: int) -> None:
        np = self.np
        b = self.bytes
        opens = (b == ord("[")) | (b == ord("{"))
        closes = (b == ord("]")) | (b == ord("}"))
        at = self.outside_strings(np.flatnonzero(opens | closes))
        if at.size == 0:
            return
        steps = np.where(opens[at], 1, -1).astype(np.int32)
        depth = np.cumsum(steps)
        over = np.flatnonzero(depth > limit)
        if over.size == 0:
            return
        raise TooDeep(limit, self._key_of(at, steps, depth, int(over[0])))

    def _key_of(self, at, steps, depth, first_over: int) -> str | None:
        """The top-level object key whose value holds bracket `first_over`."""
        if self.data.lstrip()[:1] != b"{":
            return None
        starts = self.np.flatnonzero(
            (depth[: first_over + 1] == 2) & (steps[: first_over + 1] == 1)
        )
        if starts.size == 0:
            return None
        pos = int(at[starts[-1]])  # the bracket that opens the field's value
        close = self.data.rfind(b'"', 0, pos)
        opening = self.data.rfind(b'"', 0, close) if close > 0 else -1
        if opening < 0 or self.data[close + 1 : pos].strip(b" \t\r\n:"):
            return None
        try:
            return self.data[opening + 1 : close].decode()
        except UnicodeDecodeError:
            return None

    def has_long_number(self) -> bool:
        """Whether a run of 19 digits or more stands outside every string."""
        np = self.np
        digits = ((self.bytes >= ord("0")) & (self.bytes <= ord("9"))).view(np.int8)
        edges = np.diff(digits, prepend=0, append=0)
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        long_starts = starts[ends - starts >= 19]
        return self.outside_strings(long_starts).size > 0


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
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if _LONG_RUN not in data.translate(_DIGITS_AS_ZEROS) or not _Structure(data).has_long_number():
        return  # no 19 digits in a row, or only inside strings
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
