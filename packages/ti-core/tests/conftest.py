"""ti-core test configuration: a fixed seed, the helpers module on sys.path, and the
Hypothesis profiles.

Profiles: ``default`` is what every test session runs (CI adds ``--hypothesis-seed=0``);
``properties`` (``TI_HYPOTHESIS_PROFILE=properties``, what ``nox -s properties`` sets) runs every
property test with ten times its examples, unseeded, printing the blob that reproduces a failure.
Property tests ask for their examples through ``_core_helpers.examples(n)``, which scales ``n`` by
the loaded profile.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile(
    "properties", max_examples=1000, deadline=None, derandomize=False, print_blob=True
)
if profile := os.environ.get("TI_HYPOTHESIS_PROFILE"):
    settings.load_profile(profile)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def torch_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors down the torch engine, the one accelerators use (it runs on any device)."""
    from ti_core.reduction import support

    monkeypatch.setattr(support, "uses_numpy", lambda device: False)


@pytest.fixture
def every_signal_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every signal goes to the emission worker, small ones too, instead of being written at once
    while the worker is idle: for tests of the worker and its queue."""
    from ti_core.reduction import placement

    monkeypatch.setattr(placement, "INLINE_SIGNAL_BYTES", -1)
