"""The flight recorder: a non-finite sentinel on every root forward, the events it records, and
the dense captures an event (or the training loop, :func:`ti_core.trigger_capture`) sets off.

:mod:`.options` (``Sentinel``), :mod:`.flags` (device-side flags, one read per check),
:mod:`.recorder` (the checks' state and the events; the output flags compiled graphs write are
:mod:`ti_core.compiled.slots`), :mod:`.dense` (forwards sampled in full),
:mod:`.events` (``ti.events`` rows). docs/capture.md, "Flight recorder".
"""

from ti_core.sentinel.dense import DenseSampler
from ti_core.sentinel.events import Event
from ti_core.sentinel.options import DEFAULT_DENSE_FORWARDS, Sentinel, resolve_sentinel
from ti_core.sentinel.recorder import FlightRecorder

__all__ = [
    "DEFAULT_DENSE_FORWARDS",
    "DenseSampler",
    "Event",
    "FlightRecorder",
    "Sentinel",
    "resolve_sentinel",
]
