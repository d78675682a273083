"""One call of a selected module in a compiled graph, recorded at run time as eager capture does.

What the ``ti::record_call`` operator (:mod:`ti_core.compiled.operators`) does, through the
gate, in the running sample: the same rows in its :class:`~ti_core.reduction.batch.TensorBatch`,
gradient bookkeeping in its :class:`~ti_core.capture.gradients.GradientState` and coverage gaps
as :meth:`~ti_core.capture.sample.Sample.record`, so reduction and emission are unchanged. It
lives in capture, next to that method; :mod:`ti_core.compiled` (trace time and the operators)
sits below capture and knows nothing of samples. Two differences, both forced by compiled code:

- every tensor is handed to the batch as a fresh ``detach()`` alias: inductor reuses buffers
  and its kernels write through raw pointers without bumping ``_version``, so the batch's
  "same object, same version: measure once" shortcut would repeat a stale row;
- a watched tensor's hook was registered at trace time (:mod:`ti_core.compiled.traced`); its
  gradient arrives through ``record_grad``, which calls the :class:`GradHook` made here (one
  per tensor and call: identity dedupe of eager capture is not done in compiled graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from ti_core.call_context import in_reentrant_checkpoint, now_us
from ti_core.capture.gradients import GradHook, GradientState
from ti_core.capture.sample import LEAF_REASON, REENTRANT_REASON, Sample
from ti_core.compiled.operators import LEAF, WATCH
from ti_core.compiled.traced import NESTED

NESTED_REASON: Final[str] = (
    "gradient not captured: activation checkpoint inside a compiled graph (the output is "
    "recorded; torch.compile cannot save what binds its gradient to the sample there)"
)


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
    if sample.starts:
        sample.close_start(layer, call)
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


def record_traced_start(
    sample: Sample,
    layer: int,
    paths: Sequence[str],
    tensors: Sequence[torch.Tensor],
    train: bool,
    grad_enabled: bool,
    signals: Sequence[int],
) -> None:
    """Record the start of one call in ``sample``: each tensor (``signals``: the index of its
    call signal among the sample's) in that signal's batch, as
    :meth:`~ti_core.capture.sample.Sample.record_start` does eagerly (a fresh ``detach()``
    alias each, as for outputs); the call's ``record_call`` gives them its call index."""
    stamp = now_us()
    added = []
    for path, tensor, k in zip(paths, tensors, signals, strict=True):
        signal, batch = sample.starts[k]
        try:
            batch.add(tensor.detach(), layer, 0, path, train, grad_enabled, stamp)
            added.append((batch, len(batch.rows) - 1))
        except Exception as error:
            sample.start_failed(signal, error)
    sample.open_starts.setdefault(layer, []).append(added)


__all__ = ["NESTED_REASON", "record_traced_call", "record_traced_start"]
