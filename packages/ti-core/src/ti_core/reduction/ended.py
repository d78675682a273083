"""The one hand-over from capture to emission: an :class:`EndedSignal`, given to a
:class:`SignalTarget`.

A signal of one sample ends when its capture is complete: the root forward returned
(``output``, ``parameter``), the first backward that reached the sample ended
(``output_gradient``, ``parameter_gradient``), the optimizer step after it ran
(``parameter_update``), or the observer was removed first. The capture module that sees it end
builds the :class:`EndedSignal` and calls :meth:`SignalTarget.emit`; the target (the observer)
writes or queues it (:mod:`ti_core.emission`) and names a failure by :attr:`EndedSignal.stage`.

It lives here, below capture and emission alike, so that neither imports the other: what
passes between them is a batch for the reduction, with the sample it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ti_core.entries import Gaps
from ti_core.errors import ErrorPolicy
from ti_core.reduction.batch import TensorBatch
from ti_core.stages import stage_of
from ti_schema import Signal


@dataclass(frozen=True, slots=True)
class EndedSignal:
    """One sample's signal whose capture is complete. Holds only what it emits: the snapshots,
    not the sample (whose gradient state must stay free to go with its autograd graph)."""

    signal: Signal
    sample_id: int
    forward_index: int
    batch: TensorBatch
    gaps: Gaps | None = None
    """Entries without a value in :attr:`gap_signal`, with the reason: outputs or parameters
    whose gradient cannot be captured (ended with ``output`` / ``parameter``), parameters whose
    gradient or update was not measured (with those signals)."""
    gap_signal: Signal | None = None
    """The signal of the ``gaps`` rows; None: :attr:`signal` itself."""

    @property
    def stage(self) -> str:
        """How a failure while emitting this signal is named to the error policy."""
        return stage_of(self.signal, "emission")

    @property
    def gaps_signal(self) -> Signal:
        """The ``signal`` value of the ``gaps`` rows."""
        return self.signal if self.gap_signal is None else self.gap_signal


class SignalTarget(Protocol):
    """Where capture hands what it measured (the observer): one factory of batches, one
    hand-over of ended signals."""

    @property
    def closed(self) -> bool:
        """True once the observer was removed: later signals are dropped."""
        ...

    @property
    def errors(self) -> ErrorPolicy: ...

    def new_batch(self) -> TensorBatch:
        """An empty batch for one signal of one sample."""
        ...

    def emit(self, ended: EndedSignal) -> None:
        """Write or queue ``ended``; a failure goes to the error policy as ``ended.stage``."""
        ...


__all__ = ["EndedSignal", "SignalTarget"]
