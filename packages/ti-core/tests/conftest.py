"""ti-core test configuration: a fixed seed, and the helpers module on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
