"""What emitting one ended signal means: reduce its batch, build its records, write them.

The same work whichever emitter runs it (:mod:`ti_core.emission.emitters`): that is what makes
rows identical inline and on the emission worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ti_core.capture.batch import TensorBatch
from ti_core.emission.sinks import SinkFanout
from ti_core.errors import ErrorPolicy
from ti_core.records import (
    Gaps,
    RunColumns,
    SignalName,
    histogram_batch,
    history_batch,
    unavailable_batch,
)

_STAGES: Final[dict[SignalName, str]] = {
    "output": "forward emission",
    "output_gradient": "gradient emission",
    "parameter": "parameter emission",
    "parameter_gradient": "parameter gradient emission",
    "parameter_update": "parameter update emission",
}


@dataclass(frozen=True, slots=True)
class EndedSignal:
    """One sample's signal whose capture is complete (a root forward returned, or a backward
    that delivered gradients to the sample ended). Holds only what it emits: the snapshots, not
    the sample (whose gradient state must stay free to go with its autograd graph)."""

    signal: SignalName
    sample_id: int
    forward_index: int
    batch: TensorBatch
    gaps: Gaps | None = None
    """Entries without a value in ``gap_signal``, with the reason: outputs or parameters whose
    gradient cannot be captured (with ``output`` / ``parameter``), parameters whose gradient or
    update was not measured (with those signals)."""
    gap_signal: SignalName = "output_gradient"
    """The signal of the ``gaps`` rows."""

    @property
    def stage(self) -> str:
        """How a failure while emitting this signal is named to the error policy."""
        return _STAGES[self.signal]


class SignalWriter:
    """Turns ended signals into ``ti.history`` / ``ti.histograms`` batches for the fan-out."""

    def __init__(self, columns: RunColumns, fanout: SinkFanout, errors: ErrorPolicy) -> None:
        self._columns = columns
        self._fanout = fanout
        self._errors = errors

    def write(self, ended: EndedSignal) -> None:
        """Reduce, build and write ``ended``; reduction failures go to the error policy."""
        reduced = ended.batch.finish()
        columns, signal = self._columns, ended.signal
        if reduced.entries:
            history = history_batch(
                columns,
                signal,
                ended.sample_id,
                ended.forward_index,
                reduced.entries,
                reduced.values,
                reduced.available,
                reduced.reasons,
            )
            self._fanout.write_history(history)
        if reduced.histograms:
            histograms = histogram_batch(
                columns,
                signal,
                ended.sample_id,
                ended.forward_index,
                reduced.histogram_entries,
                reduced.histograms,
            )
            self._fanout.write_histograms(histograms)
        for error in reduced.errors:
            self._errors.handle("reduction", error)
        if ended.gaps:
            gaps = unavailable_batch(
                columns,
                ended.gap_signal,
                ended.sample_id,
                ended.forward_index,
                ended.gaps.entries,
                ended.gaps.reasons,
            )
            self._fanout.write_history(gaps)


__all__ = ["EndedSignal", "SignalWriter"]
