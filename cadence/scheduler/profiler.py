"""The torch profiler of the scheduler, started and stopped by control messages.

Traces go only under the operator's --profile-dir: a request may name one plain
subdirectory of it (the front checked the name; a path that leaves the directory is refused
here too). With `start_step`, the profile is armed and starts once that many forward steps
have run (SGLang's warm-up skip); with `num_steps`, it stops by itself after that many
profiled steps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Profiler:
    def __init__(self, root: str, activities: Callable[[], list]):
        self.root = root
        self.activities = activities
        self._profile: Any = None  # the running torch.profiler.profile (torch loads lazily)
        self._dir = ""
        self._steps_left: int | None = None
        self._steps_to_start: int | None = None  # armed: forward steps before it starts

    @property
    def is_running(self) -> bool:
        return self._profile is not None

    @property
    def is_armed(self) -> bool:
        return self._steps_to_start is not None

    def start(
        self, name: str | None, num_steps: int | None, start_step: int | None = None
    ) -> tuple[bool, str]:
        if self._profile is not None or self.is_armed:
            return False, "a profile is already running (or armed to start); stop it first"
        self._dir = self._directory(name)
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        self._steps_left = num_steps
        if start_step:
            self._steps_to_start = start_step
            return True, f"profiling into {self._dir} after {start_step} forward steps"
        self._begin()
        return True, f"profiling into {self._dir}"

    def _begin(self) -> None:
        import torch

        self._steps_to_start = None
        self._profile = torch.profiler.profile(activities=self.activities())
        self._profile.__enter__()

    def stop(self) -> tuple[bool, str]:
        if self.is_armed:  # stopped before its first step: nothing was recorded
            self._steps_to_start = self._steps_left = None
            return True, "the profile was stopped before it started; no trace was written"
        if self._profile is None:
            return False, "no profile is running; start one first"
        profile, self._profile, self._steps_left = self._profile, None, None
        profile.__exit__(None, None, None)
        path = os.path.join(self._dir, f"trace-{int(time.time())}-{os.getpid()}.json")
        profile.export_chrome_trace(path)
        return True, path

    def on_step(self) -> None:
        """A forward step ran: count it against start_step, or against num_steps."""
        if self._steps_to_start is not None:
            self._steps_to_start -= 1
            if self._steps_to_start <= 0:
                try:
                    self._begin()
                except Exception:  # the profiler's failure must not fail the step's requests
                    logger.exception("the armed profile could not start")
                    self._steps_to_start = self._steps_left = None
            return
        if self._profile is not None and self._steps_left is not None:
            self._steps_left -= 1
            if self._steps_left <= 0:
                self.stop()

    def _directory(self, name: str | None) -> str:
        root = os.path.realpath(self.root)
        path = os.path.realpath(os.path.join(root, name)) if name else root
        if os.path.commonpath([path, root]) != root:
            raise ValueError(f"output_dir {name!r} is not a subdirectory of --profile-dir")
        return path
