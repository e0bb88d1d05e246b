"""The speech pipeline's stages in real processes; the helpers of tests/unit/speech on the path."""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parents[2] / "unit" / "speech")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
