"""What the parameter signals report to (the observer), shared by their gradient and update
sides (:mod:`~ti_core.capture.parameter_gradients`, :mod:`~ti_core.capture.updates`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ti_core.capture.batch import TensorBatch
from ti_core.errors import ErrorPolicy
from ti_core.records import Entry, SignalName
from ti_core.reduction.support import dtype_name


class ParameterTarget(Protocol):
    """What the parameter signals report to (the observer)."""

    @property
    def closed(self) -> bool:
        """True once the observer was removed."""
        ...

    @property
    def errors(self) -> ErrorPolicy: ...

    def new_batch(self) -> TensorBatch:
        """An empty batch for one signal of one sample."""
        ...

    def finish_parameters(
        self,
        signal: SignalName,
        sample_id: int,
        forward_index: int,
        batch: TensorBatch,
        gaps: Sequence[tuple[Entry, str]],
    ) -> None:
        """Emit ``batch`` (and ``gaps``: entries with the reason they have no value) as
        ``signal`` rows of sample ``sample_id``."""
        ...


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


__all__ = ["ParameterTarget", "add_entry", "measured_entry"]
