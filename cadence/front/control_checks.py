"""The checks of control calls (profile, sessions, weight updates), once for every adapter.

`EngineClient`'s named control methods run them, so HTTP, both gRPC services and the
in-process `Engine` refuse the same values with the same words, before anything reaches
the scheduler. Integer ranges are also what the HTTP bodies are parsed against
(`serving.control`): an integer the message codec cannot carry (above 2^64) is refused
before it is sent.
"""

from __future__ import annotations

import os
from typing import Any

from cadence.errors import InvalidParameter

INT64_MAX = 2**63 - 1
# The range of every integer field of a control call, by name; one not listed here may
# still be no larger than a signed 64-bit integer.
INT_RANGES: dict[str, tuple[int, int]] = {
    "capacity_of_str_len": (0, INT64_MAX),
    "num_steps": (1, INT64_MAX),
    "start_step": (0, INT64_MAX),
}
MAX_SESSION_ID_CHARS = 256
MAX_WEIGHT_VERSION_CHARS = 256  # every generation output carries it
MAX_SESSION_TIMEOUT_S = 7 * 86400


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


def check_session(session_id: str | None, timeout: float | None) -> None:
    """A session the client names (None: the server picks one) and its idle timeout."""
    if session_id is not None and not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise InvalidParameter(
            "session_id", f"session_id must be 1 to {MAX_SESSION_ID_CHARS} characters"
        )
    if timeout is not None and not 0 < timeout <= MAX_SESSION_TIMEOUT_S:
        raise InvalidParameter(
            "timeout", f"timeout must be in (0, {MAX_SESSION_TIMEOUT_S}] seconds"
        )


def check_model_path(model_path: Any) -> None:
    if not isinstance(model_path, str) or not model_path:
        raise InvalidParameter(
            "model_path", "model_path (a .gguf file or model directory) is required"
        )


def check_weight_version(name: str, version: Any) -> None:
    """A weights' version label: 1 to MAX_WEIGHT_VERSION_CHARS printable characters."""
    if (
        not isinstance(version, str)
        or not 0 < len(version) <= MAX_WEIGHT_VERSION_CHARS
        or not version.isprintable()
    ):
        raise InvalidParameter(
            name,
            f"{name} must be a string of 1 to {MAX_WEIGHT_VERSION_CHARS} printable characters",
        )
