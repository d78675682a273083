"""Where a FutureWarning about a 0.8.0 object points: the user's call, not ti-core."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

_PACKAGE_DIR: Final[str] = str(Path(__file__).resolve().parents[1])
"""ti-core's source directory: its frames are skipped."""


def user_stacklevel() -> int:
    """``stacklevel`` of the first frame outside ti-core and contextlib: a warning points at
    the user's ``inject_observer`` (or ``observe``) call."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_PACKAGE_DIR) or name.endswith("contextlib.py")):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


__all__ = ["user_stacklevel"]
