"""The ``input`` signal: each tensor among a selected module's positional and keyword
arguments, as the call starts.

Paths follow the output's rules (0.8.0's): ``[i]`` for the i-th positional argument,
``['name']`` for a keyword argument, nested as in an output (``[0][1]``, ``['cache'].key``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ti_core.call_signals import CallSignal, Walk


def _arguments(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], walk: Walk
) -> list[tuple[str, torch.Tensor]]:
    return [*walk(args), *walk(dict(kwargs))]


SIGNAL = CallSignal("input", _arguments)
