"""What ``record_call`` does at run time: one call of a selected module, recorded as eager does.

The same rows in the sample's :class:`~ti_core.capture.batch.TensorBatch`, gradient
bookkeeping in its :class:`~ti_core.capture.gradients.GradientState` and coverage gaps as
:meth:`ti_core.capture.sample.Sample.record`, so reduction and emission are unchanged. Two
differences, both forced by compiled code:

- every tensor is handed to the batch as a fresh ``detach()`` alias: inductor reuses buffers
  and its kernels write through raw pointers without bumping ``_version``, so the batch's
  "same object, same version: measure once" shortcut would repeat a stale row;
- a watched tensor's hook was registered at trace time (:mod:`ti_core.compiled.traced`); its
  gradient arrives through ``record_grad``, which calls the :class:`GradHook` made here (one
  per tensor and call: identity dedupe of eager capture is not done in compiled graphs).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Final

import torch

from ti_core.capture.context import in_reentrant_checkpoint, now_us
from ti_core.capture.gradients import GradHook, GradientState
from ti_core.capture.sample import LEAF_REASON, REENTRANT_REASON, Sample
from ti_core.compiled.operators import LEAF, WATCH
from ti_core.compiled.traced import NESTED

NESTED_REASON: Final[str] = (
    "gradient not captured: activation checkpoint inside a compiled graph (the output is "
    "recorded; torch.compile cannot save what binds its gradient to the sample there)"
)


class Sites:
    """The tensor paths of each traced output, numbered at trace time (shared by threads)."""

    def __init__(self) -> None:
        self._numbers: dict[tuple[str, ...], int] = {}
        self._paths: list[tuple[str, ...]] = []
        self._lock = threading.Lock()

    def intern(self, paths: tuple[str, ...]) -> int:
        """The number of ``paths`` (stable: the same paths always get the same number)."""
        with self._lock:
            number = self._numbers.get(paths)
            if number is None:
                number = self._numbers[paths] = len(self._paths)
                self._paths.append(paths)
            return number

    def paths(self, number: int) -> tuple[str, ...]:
        return self._paths[number]


def record_traced_call(
    sample: Sample,
    layer: int,
    paths: Sequence[str],
    tensors: Sequence[torch.Tensor],
    train: bool,
    grad_enabled: bool,
    kinds: Sequence[int],
) -> list[GradHook | None]:
    """Record one call in ``sample``; return, per tensor, the gradient hook that its
    ``record_grad`` calls (None: no gradient will be recorded for it)."""
    call = sample.calls.get(layer, 0)
    sample.calls[layer] = call + 1
    hooks: list[GradHook | None] = [None] * len(tensors)
    if not tensors:
        return hooks
    stamp = now_us()
    forward = sample.forward
    reentrant: bool | None = None
    for j, (path, tensor, kind) in enumerate(zip(paths, tensors, kinds, strict=True)):
        forward.add(tensor.detach(), layer, call, path, train, grad_enabled, stamp)
        if not sample.output_gradients:  # the output_gradient signal is not recorded
            continue
        row = len(forward.rows) - 1
        if kind == WATCH:
            state = sample.gradients
            if state is None:
                state = sample.gradients = GradientState(
                    sample.target, sample.sample_id, sample.forward_index, forward.rows
                )
            hooks[j] = GradHook(state, row)
        elif kind == LEAF:
            sample.gaps.add(forward.entry(row), LEAF_REASON)
        elif kind == NESTED:
            sample.gaps.add(forward.entry(row), NESTED_REASON)
        elif not grad_enabled and (tensor.is_floating_point() or tensor.is_complex()):
            if reentrant is None:
                reentrant = in_reentrant_checkpoint()
            if reentrant:
                sample.gaps.add(forward.entry(row), REENTRANT_REASON)
    return hooks


__all__ = ["NESTED_REASON", "Sites", "record_traced_call"]
