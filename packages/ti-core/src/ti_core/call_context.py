"""Execution context of a module call: time stamps, backward and checkpoint detection."""

from __future__ import annotations

import sys
import time
from types import CodeType

from ti_core import _torch

_CHECKPOINT_CODES: tuple[CodeType, ...]
try:
    from torch.utils.checkpoint import CheckpointFunction

    _CHECKPOINT_CODES = (CheckpointFunction.forward.__code__,)
except (ImportError, AttributeError):  # pragma: no cover - depends on the torch build
    _CHECKPOINT_CODES = ()

_STACK_LIMIT = 64


def now_us() -> int:
    """Wall-clock microseconds since the Unix epoch (the ``timestamp`` column's unit)."""
    return time.time_ns() // 1000


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread.

    Module calls seen then are recomputations (activation checkpointing), not new forwards.
    """
    return _torch.current_graph_task_id() != -1


def in_reentrant_checkpoint() -> bool:
    """True inside the forward of ``torch.utils.checkpoint(..., use_reentrant=True)``.

    Walks at most 64 frames; only called for sampled calls that run with grad disabled.
    """
    if not _CHECKPOINT_CODES:
        return False
    frame = sys._getframe(1)
    depth = 0
    while frame is not None and depth < _STACK_LIMIT:
        if frame.f_code in _CHECKPOINT_CODES:
            return True
        frame = frame.f_back  # type: ignore[assignment]
        depth += 1
    return False
