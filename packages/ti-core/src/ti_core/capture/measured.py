"""A parameter signal's entry as measured on a tensor, and its recording in a batch (shared by
:mod:`~ti_core.capture.parameters`, :mod:`~ti_core.capture.parameter_gradients` and
:mod:`~ti_core.capture.updates`)."""

from __future__ import annotations

import torch

from ti_core.entries import Entry
from ti_core.reduction.batch import TensorBatch
from ti_core.reduction.support import dtype_name


def measured_entry(entry: Entry, tensor: torch.Tensor, stamp: int) -> Entry:
    """``entry`` for ``tensor`` measured at ``stamp``: its shape and dtype."""
    return Entry(
        entry.layer,
        entry.call_index,
        entry.path,
        entry.train,
        entry.grad_enabled,
        tuple(tensor.shape),
        dtype_name(tensor.dtype),
        stamp,
    )


def add_entry(batch: TensorBatch, entry: Entry, tensor: torch.Tensor) -> None:
    """Record ``tensor`` in ``batch`` under ``entry``'s identity (shape and dtype: the
    tensor's)."""
    batch.add(
        tensor,
        entry.layer,
        entry.call_index,
        entry.path,
        entry.train,
        entry.grad_enabled,
        entry.timestamp_us,
    )


__all__ = ["add_entry", "measured_entry"]
