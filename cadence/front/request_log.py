"""--log-requests: each generation request written to the log when it arrives and when it
ends, at SGLang's levels of detail (--log-requests-level):

- 0: what it is (rid, prompt length, stream, adapter) and how it ended (finish reason,
  lengths, cached tokens, latency);
- 1: that, and its sampling parameters;
- 2: that, and its prompt and output, each cut to `PARTIAL_CHARS` characters (the default);
- 3: that, with the prompt and output whole.

One line per event, at INFO on the `cadence.requests` logger, so a deployment can route or
silence them on their own. Each front process (--api-workers) logs the requests it serves;
/configure_logging (SGLang's route) turns it on or off and sets the level for all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from cadence.io_struct import TokenizedGenerateReqInput

logger = logging.getLogger("cadence.requests")

LEVELS = (0, 1, 2, 3)
DEFAULT_LEVEL = 2  # SGLang's default
PARTIAL_CHARS = 2048  # level 2's cut, per logged value


def check_level(level: int) -> None:
    if level not in LEVELS:
        raise ValueError(f"log_requests_level must be one of {list(LEVELS)}, got {level}")


def _cut(value: Any, limit: int | None) -> str:
    text = repr(value)
    if limit is not None and len(text) > limit:
        return f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


@dataclass
class RequestLog:
    """Writes generation requests to the log when `on`, at `level`. With several front
    processes a shared value holds both (`shared`), so /configure_logging through one front
    sets them for all."""

    on: bool = False
    level: int = DEFAULT_LEVEL
    shared: Any = None  # a multiprocessing RawValue("b"): `encode(on, level)`

    def __post_init__(self) -> None:
        check_level(self.level)

    @staticmethod
    def encode(on: bool, level: int) -> int:
        return level if on else -level - 1

    def state(self) -> tuple[bool, int]:
        """(on, level) as every front process sees them now."""
        if self.shared is None:
            return self.on, self.level
        value = self.shared.value
        return (True, value) if value >= 0 else (False, -value - 1)

    def configure(self, on: bool | None = None, level: int | None = None) -> None:
        """SGLang's /configure_logging: what is given changes, what is None stays."""
        if level is not None:
            check_level(level)
        was_on, was_level = self.state()
        self.on = was_on if on is None else on
        self.level = was_level if level is None else level
        if self.shared is not None:
            self.shared.value = self.encode(self.on, self.level)

    def _level(self) -> int | None:
        """The level to write at now, or None when nothing is to be written."""
        on, level = self.state()
        return level if on and logger.isEnabledFor(logging.INFO) else None

    def received(self, tok: TokenizedGenerateReqInput) -> None:
        level = self._level()
        if level is None:
            return
        limit = PARTIAL_CHARS if level == 2 else None
        parts = [f"rid={tok.rid}", f"prompt_tokens={len(tok.input_ids)}", f"stream={tok.stream}"]
        if tok.lora_path:
            parts.append(f"lora={tok.lora_path}")
        if level >= 1:
            params = tok.sampling_params
            fields = {f: getattr(params, f) for f in params.__struct_fields__}
            parts.append(f"sampling_params={_cut(fields, limit)}")
        if level >= 2:
            if tok.input_text is not None:
                parts.append(f"text={_cut(tok.input_text, limit)}")
            else:
                parts.append(f"input_ids={_cut(tok.input_ids, limit)}")
        logger.info("Receive: %s", " ".join(parts))

    def finished(
        self, rid: str, meta: dict[str, Any], text: str, output_ids: list[int], latency_s: float
    ) -> None:
        level = self._level()
        if level is None:
            return
        limit = PARTIAL_CHARS if level == 2 else None
        parts = [f"rid={rid}", f"finish_reason={meta.get('finish_reason')!r}"]
        for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            if key in meta:
                parts.append(f"{key}={meta[key]}")
        parts.append(f"e2e_latency={latency_s:.3f}s")
        if level >= 2:
            parts.append(f"text={_cut(text, limit)}")
            parts.append(f"output_ids={_cut(output_ids, limit)}")
        logger.info("Finish: %s", " ".join(parts))
