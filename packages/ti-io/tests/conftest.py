"""ti-io test configuration: the helpers module on sys.path, a synthetic-run factory and the
S3 server fixtures (s3_server.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _io_helpers import Synth, make_run
from s3_server import moto, s3  # noqa: F401  (fixtures: a moto S3 server, a bucket on it)

from ti_schema import RunInfo


@pytest.fixture
def synth() -> Callable[..., Synth]:
    def build(run: RunInfo | None = None, **kwargs: Any) -> Synth:
        return Synth(run or make_run(), **kwargs)

    return build
