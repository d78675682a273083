"""What emitting one ended signal means: reduce its batch, build its records, write them.

The same work whichever emitter runs it (:mod:`ti_core.emission.emitters`): that is what makes
rows identical inline and on the emission worker.
"""

from __future__ import annotations

from ti_core.emission.records import RunColumns, histogram_batch, history_batch, unavailable_batch
from ti_core.emission.sinks import SinkFanout
from ti_core.errors import ErrorPolicy
from ti_core.reduction.ended import EndedSignal
from ti_core.stages import REDUCTION


class SignalWriter:
    """Turns ended signals into ``ti.history`` / ``ti.histograms`` batches for the fan-out."""

    def __init__(self, columns: RunColumns, fanout: SinkFanout, errors: ErrorPolicy) -> None:
        self._columns = columns
        self._fanout = fanout
        self._errors = errors

    def write(self, ended: EndedSignal) -> None:
        """Reduce ``ended``'s batch on this thread (the emitter chose it,
        :mod:`ti_core.reduction.placement`), build and write its records; reduction failures
        go to the error policy."""
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
            self._errors.handle(REDUCTION, error)
        if ended.gaps:
            gaps = unavailable_batch(
                columns,
                ended.gaps_signal,
                ended.sample_id,
                ended.forward_index,
                ended.gaps.entries,
                ended.gaps.reasons,
            )
            self._fanout.write_history(gaps)


__all__ = ["SignalWriter"]
