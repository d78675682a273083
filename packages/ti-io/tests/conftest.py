"""ti-io test configuration: the helpers module on sys.path, and a synthetic-run factory."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _io_helpers import Synth, make_run

from ti_schema import RunInfo


@pytest.fixture
def synth() -> Callable[..., Synth]:
    def build(run: RunInfo | None = None, **kwargs: Any) -> Synth:
        return Synth(run or make_run(), **kwargs)

    return build
