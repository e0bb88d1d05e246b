"""The bodies of the control routes (abort, pause, profile, weight update), checked at the edge.

Each is a typed struct: a wrong type, a wrong JSON shape (an array or a string where an
object belongs), an unknown enum value, a non-boolean boolean or an integer outside its
range is an `InvalidParameter` naming the field, so nothing malformed reaches the scheduler
(an integer the message codec cannot carry, above 2^64, would otherwise fail on the way). Fields that SGLang's routes
take and this server does not use are accepted and ignored, like any unknown field.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from cadence.errors import InvalidParameter, readable
from cadence.io_struct import PAUSE_MODES, PauseMode


class _Body(msgspec.Struct, kw_only=True):
    pass


class AbortBody(_Body, kw_only=True):
    rid: str | None = None  # the request (and its n > 1 samples) to abort
    abort_all: bool = False  # abort every live request


class PauseBody(_Body, kw_only=True):
    mode: PauseMode = "abort"


class ProfileBody(_Body, kw_only=True):
    # A name for the trace's subdirectory under the server's --profile-dir (never a path).
    output_dir: str | None = None
    num_steps: int | None = None  # stop by itself after this many forward steps (>= 1)
    start_step: int | None = None  # start after this many forward steps (>= 0; 0: at once)


class UpdateWeightsBody(_Body, kw_only=True):
    model_path: str  # a .gguf file or a Hugging Face directory on the server's disk
    load_format: str | None = None


class OpenSessionBody(_Body, kw_only=True):
    capacity_of_str_len: int = 0  # SGLang's capacity hint; accepted, not enforced
    session_id: str | None = None  # None: the server picks one
    streaming: bool = False  # every request appends to the session's latest one
    timeout: float | None = None  # idle seconds before the server closes it


class CloseSessionBody(_Body, kw_only=True):
    session_id: str


INT64_MAX = 2**63 - 1
# The range of every integer field of a control body, by name; one not listed here may
# still be no larger than a signed 64-bit integer.
INT_RANGES: dict[str, tuple[int, int]] = {
    "capacity_of_str_len": (0, INT64_MAX),
    "num_steps": (1, INT64_MAX),
    "start_step": (0, INT64_MAX),
}


def parse(cls: type, body: Any):
    """`body` (decoded JSON) as a `cls`; raises InvalidParameter naming the field at fault."""
    if not isinstance(body, dict):
        raise InvalidParameter(None, f"the request body must be a JSON object, got {_kind(body)}")
    known = {k: v for k, v in body.items() if k in cls.__struct_fields__}
    if cls is UpdateWeightsBody and not isinstance(known.get("model_path"), str):
        raise InvalidParameter(
            "model_path", "model_path (a .gguf file or model directory) is required"
        )
    if cls is CloseSessionBody and not isinstance(known.get("session_id"), str):
        raise InvalidParameter("session_id", "session_id (a string) is required")
    try:
        obj = msgspec.convert(known, cls)
    except msgspec.ValidationError as e:
        if cls is PauseBody and "mode" in known:
            raise InvalidParameter(
                "mode", f"mode must be one of {', '.join(PAUSE_MODES)}, got {known['mode']!r}"
            ) from None
        raise readable(e) from None
    if isinstance(obj, AbortBody) and (obj.rid is None) == (not obj.abort_all):
        raise InvalidParameter("rid", "give either a rid (string) or abort_all: true")
    if isinstance(obj, AbortBody) and obj.rid is not None and not obj.rid:
        raise InvalidParameter("rid", "rid must not be empty")
    for name in obj.__struct_fields__:
        check_int_range(name, getattr(obj, name))
    if isinstance(obj, ProfileBody):
        check_profile_name(obj.output_dir)
    if isinstance(obj, OpenSessionBody):  # here, not in __post_init__: msgspec would drop `param`
        if obj.session_id is not None and not 0 < len(obj.session_id) <= 256:
            raise InvalidParameter("session_id", "session_id must be 1 to 256 characters")
        if obj.timeout is not None and not 0 < obj.timeout <= 7 * 86400:
            raise InvalidParameter("timeout", "timeout must be in (0, 604800] seconds")
    return obj


def check_int_range(name: str, value: Any) -> None:
    """An integer field inside its range (`INT_RANGES`, else a signed 64-bit integer)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return
    low, high = INT_RANGES.get(name, (-INT64_MAX - 1, INT64_MAX))
    if not low <= value <= high:
        # str() of a huge integer is slow, then refused (Python's int_max_str_digits)
        bits = value.bit_length()
        shown = str(value) if bits <= 100 else f"a number of about {int(bits * 0.30103) + 1} digits"
        raise InvalidParameter(
            name, f"{name} must be an integer in [{_bound(low)}, {_bound(high)}], got {shown}"
        )


def _bound(value: int) -> str:
    return {INT64_MAX: "2^63-1", -INT64_MAX - 1: "-2^63"}.get(value, str(value))


def check_pause_mode(mode: Any) -> str:
    if mode not in PAUSE_MODES:
        raise InvalidParameter(
            "mode", f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}"
        )
    return mode


def check_profile_name(name: str | None) -> None:
    """A trace subdirectory name: one plain path component. Profiles are written only under
    the directory the operator chose (--profile-dir); a client never names a path."""
    if name is None:
        return
    if (
        not name
        or len(name) > 128
        or name in (".", "..")
        or os.sep in name
        or "/" in name
        or "\\" in name
        or "\0" in name
        or not name.isprintable()
    ):
        raise InvalidParameter(
            "output_dir",
            "output_dir must be a plain name (no path) for a subdirectory of "
            f"the server's --profile-dir, got {name!r}",
        )


def _kind(value: Any) -> str:
    return {
        list: "an array",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), type(value).__name__)
