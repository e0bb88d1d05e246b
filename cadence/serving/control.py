"""The bodies of the control routes (abort, pause, profile, weight update, sessions).

Each is a typed struct: a wrong type, a wrong JSON shape (an array or a string where an
object belongs), an unknown enum value, a non-boolean boolean or an integer outside its
range is an `InvalidParameter` naming the field (an integer the message codec cannot carry,
above 2^64, would otherwise fail on the way). What the values mean (a profile name, a
session's id and timeout) is checked by the engine client's named control methods, for
every adapter alike (`front.control_checks`). Fields that SGLang's routes take and this
server does not use are accepted and ignored, like any unknown field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from cadence.errors import InvalidParameter
from cadence.front.control_checks import check_int_range, check_model_path
from cadence.io_struct import PAUSE_MODES, PauseMode
from cadence.serving.body import json_object, parse_struct


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


def parse(cls: type, body: Any):
    """`body` (decoded JSON) as a `cls`; raises InvalidParameter naming the field at fault."""
    fields = json_object(body)
    if cls is UpdateWeightsBody and not isinstance(fields.get("model_path"), str):
        check_model_path(None)
    if cls is CloseSessionBody and not isinstance(fields.get("session_id"), str):
        raise InvalidParameter("session_id", "session_id (a string) is required")
    try:
        obj = parse_struct(cls, fields)
    except InvalidParameter as e:
        if cls is PauseBody and e.param == "mode":
            raise InvalidParameter(
                "mode", f"mode must be one of {', '.join(PAUSE_MODES)}, got {fields['mode']!r}"
            ) from None
        raise
    if isinstance(obj, AbortBody) and (obj.rid is None) == (not obj.abort_all):
        raise InvalidParameter("rid", "give either a rid (string) or abort_all: true")
    if isinstance(obj, AbortBody) and obj.rid is not None and not obj.rid:
        raise InvalidParameter("rid", "rid must not be empty")
    for name in obj.__struct_fields__:  # before the engine client's checks, as the codec needs
        check_int_range(name, getattr(obj, name))
    return obj
