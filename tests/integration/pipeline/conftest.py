"""Pipelines of real stage processes over real sockets and relays, with the small executors of
tests/unit/pipeline (importable by the stage processes: the directory is put on sys.path
here, and every started process inherits sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HELPERS = str(Path(__file__).resolve().parents[2] / "unit" / "pipeline")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

from pipeline_checks import segments_of  # noqa: E402


@pytest.fixture
def no_leftover_segments():
    """After the test: no relay segment of any pipeline it started is left in /dev/shm."""
    started = []
    yield started
    for pipeline in started:
        assert segments_of(pipeline) == [], segments_of(pipeline)
