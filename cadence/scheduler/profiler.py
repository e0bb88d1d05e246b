"""The torch profiler of the scheduler, started and stopped by control messages.

Traces go only under the operator's --profile-dir: a request may name one plain
subdirectory of it (the front checked the name; a path that leaves the directory is refused
here too). With `num_steps`, the profile stops by itself after that many forward steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


class Profiler:
    def __init__(self, root: str, activities: Callable[[], list]):
        self.root = root
        self.activities = activities
        self._profile = None  # the running torch.profiler.profile
        self._dir = ""
        self._steps_left: int | None = None

    @property
    def is_running(self) -> bool:
        return self._profile is not None

    def start(self, name: str | None, num_steps: int | None) -> tuple[bool, str]:
        import torch

        if self._profile is not None:
            return False, "a profile is already running"
        self._dir = self._directory(name)
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        self._profile = torch.profiler.profile(activities=self.activities())
        self._profile.__enter__()
        self._steps_left = num_steps
        return True, f"profiling into {self._dir}"

    def stop(self) -> tuple[bool, str]:
        if self._profile is None:
            return False, "no profile is running; start one first"
        profile, self._profile, self._steps_left = self._profile, None, None
        profile.__exit__(None, None, None)
        path = os.path.join(self._dir, f"trace-{int(time.time())}-{os.getpid()}.json")
        profile.export_chrome_trace(path)
        return True, path

    def on_step(self) -> None:
        """A forward step ran: count it against num_steps."""
        if self._steps_left is not None:
            self._steps_left -= 1
            if self._steps_left <= 0:
                self.stop()

    def _directory(self, name: str | None) -> str:
        root = os.path.realpath(self.root)
        path = os.path.realpath(os.path.join(root, name)) if name else root
        if os.path.commonpath([path, root]) != root:
            raise ValueError(f"output_dir {name!r} is not a subdirectory of --profile-dir")
        return path
