"""The bodies of the control routes (abort, pause, profile, weight update, sessions, LoRA
adapters).

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
from cadence.front.request_log import check_level
from cadence.io_struct import PAUSE_MODES, LoRAUpdateOutput, PauseMode
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
    weight_version: str | None = None  # the new weights' version (None: unchanged)


class UpdateWeightVersionBody(_Body, kw_only=True):
    new_version: str  # the version the served weights carry from now on
    abort_all_requests: bool = True  # abort every live request first (SGLang's default)


class OpenSessionBody(_Body, kw_only=True):
    capacity_of_str_len: int = 0  # SGLang's capacity hint; accepted, not enforced
    session_id: str | None = None  # None: the server picks one
    streaming: bool = False  # every request appends to the session's latest one
    timeout: float | None = None  # idle seconds before the server closes it


class CloseSessionBody(_Body, kw_only=True):
    session_id: str


class LoadLoRABody(_Body, kw_only=True):
    lora_name: str  # what requests name it by (lora_path, model="base:name")
    lora_path: str  # the adapter's directory on the server's disk (PEFT format)
    pinned: bool = False  # never evicted to make room for another


class UnloadLoRABody(_Body, kw_only=True):
    lora_name: str


class ConfigureLoggingBody(_Body, kw_only=True):
    log_requests: bool | None = None  # turn request logging on or off
    log_requests_level: int | None = None  # 0, 1, 2 or 3 (see --log-requests-level)
    # SGLang's request and crash dumps: not kept by this server, so refused when asked for.
    dump_requests_folder: str | None = None
    dump_requests_threshold: int | None = None
    crash_dump_folder: str | None = None


# Fields a body must carry, and the error when one is missing (before any type check).
_REQUIRED: dict[type, dict[str, str]] = {
    CloseSessionBody: {"session_id": "session_id (a string) is required"},
    LoadLoRABody: {
        "lora_name": "lora_name (a string) is required",
        "lora_path": "lora_path (the adapter's directory) is required",
    },
    UnloadLoRABody: {"lora_name": "lora_name (a string) is required"},
    UpdateWeightVersionBody: {"new_version": "new_version (a string) is required"},
}


def parse(cls: type, body: Any):
    """`body` (decoded JSON) as a `cls`; raises InvalidParameter naming the field at fault."""
    fields = json_object(body)
    if cls is UpdateWeightsBody and not isinstance(fields.get("model_path"), str):
        check_model_path(None)
    for name, message in _REQUIRED.get(cls, {}).items():
        if not isinstance(fields.get(name), str):
            raise InvalidParameter(name, message)
    try:
        obj = parse_struct(cls, fields)
    except InvalidParameter as e:
        if cls is PauseBody and e.param == "mode":
            raise InvalidParameter(
                "mode", f"mode must be one of {', '.join(PAUSE_MODES)}, got {fields['mode']!r}"
            ) from None
        raise
    if isinstance(obj, ConfigureLoggingBody):
        for name in ("dump_requests_folder", "dump_requests_threshold", "crash_dump_folder"):
            if getattr(obj, name) not in (None, ""):
                raise InvalidParameter(
                    name, f"{name}: this server keeps no request or crash dumps; remove it"
                )
        if obj.log_requests_level is not None:
            try:
                check_level(obj.log_requests_level)
            except ValueError as e:
                raise InvalidParameter("log_requests_level", str(e)) from None
    if isinstance(obj, AbortBody) and (obj.rid is None) == (not obj.abort_all):
        raise InvalidParameter("rid", "give either a rid (string) or abort_all: true")
    if isinstance(obj, AbortBody) and obj.rid is not None and not obj.rid:
        raise InvalidParameter("rid", "rid must not be empty")
    for name in obj.__struct_fields__:  # before the engine client's checks, as the codec needs
        check_int_range(name, getattr(obj, name))
    return obj


def lora_update_body(out: LoRAUpdateOutput) -> dict[str, Any]:
    """A load's or an unload's answer as SGLang's routes give it: {success, error_message,
    loaded_adapters: {name: path}} (200 when it succeeded, 400 when not)."""
    loaded = {a.name: a.path for a in out.loaded_adapters}
    return {
        "success": out.success,
        "error_message": out.error_message,
        # null where the call failed before the scheduler answered with the set (SGLang's)
        "loaded_adapters": loaded if loaded or out.success else None,
    }
