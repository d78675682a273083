"""torchinstruments 0.8.0 reducers and sinks, accepted unchanged and adapted at the boundary.

The single-package predecessor documented two extension points, and code written for them keeps
working here, with one ``FutureWarning`` per adapted object naming today's form:

- a **reducer** is a callable ``reducer(tensor) -> {metric_name: value}`` (values: numbers,
  bools or one-element tensors; several metrics per call). Today a custom metric is
  ``Reducer(name, fn)`` with ``fn(tensor)`` returning one number. :func:`adapt_reducers` learns
  the metric names by calling the old reducer on small probe tensors at ``inject_observer``
  (:data:`PROBE_SHAPES`, until one call succeeds) and turns it into one ``Reducer`` per name
  (the reducer still runs once per measured tensor; its result is shared by those ``Reducer``
  objects). One that raises on every probe is still attached, as one metric named after it:
  its errors at the forward go through ``error_policy`` like any reducer's.
- a **sink** has ``initialize(run, modules)``, ``observe(sample)`` and ``close()`` and receives
  the 0.8.0 records (``RunRecord``, ``ModuleRecord``, ``SampleRecord`` ...). Today a sink
  implements :class:`ti_core.Sink` and receives Arrow record batches. :class:`LegacySink`
  rebuilds the 0.8.0 records from those batches: one ``SampleRecord`` per sampled forward
  (``SampleState.FORWARD_COMPLETE``, the outputs) and one per observed backward
  (``BACKWARD_OBSERVED``, the output gradients, with that forward's outputs), tensor paths
  spelled as 0.8.0 did (``output``, ``output.0``, ``grad_output.aux.0``), histograms named
  ``distribution``. The record classes are torchinstruments' own when it is installed (so
  ``sample.state is SampleState.FORWARD_COMPLETE`` holds), else the look-alikes of
  :mod:`ti_core.legacy.records`.

What 0.8.0 records held that ti-core does not produce: ``TensorRecord.device`` is
``"unknown"``, ``SampleRecord.collection_duration_ms`` is 0.0 and ``errors`` is empty (failures
go through the error policy instead); rows that only record a gradient coverage gap (a leaf
output, reentrant checkpointing), which 0.8.0 did not have, are not passed on.

Modules: :mod:`~ti_core.legacy.records` (the record classes), :mod:`~ti_core.legacy.reducers`
(adapting reducers), :mod:`~ti_core.legacy.sink` (adapting sinks, :class:`LegacySink`); the
tensor-path spelling, both ways, is :mod:`ti_schema.legacy_paths` (``ti upgrade`` uses it too).
"""

from __future__ import annotations

from ti_core.legacy.records import (
    LEGACY_SCHEMA_VERSION,
    Absent,
    CollectionRecord,
    ErrorRecord,
    HistogramRecord,
    ModuleCallRecord,
    ModuleRecord,
    ReducerRecord,
    RunRecord,
    SampleRecord,
    SampleState,
    SamplingRecord,
    TensorRecord,
    record_types,
)
from ti_core.legacy.reducers import (
    PROBE_SHAPES,
    AdaptedReducers,
    LearnedNames,
    adapt_reducers,
    is_legacy_reducer,
)
from ti_core.legacy.sink import (
    FORWARD_MEMORY,
    HISTOGRAM_NAME,
    LegacySink,
    adapt_sinks,
    is_legacy_sink,
)
from ti_schema.legacy_paths import legacy_path

__all__ = [
    "FORWARD_MEMORY",
    "HISTOGRAM_NAME",
    "LEGACY_SCHEMA_VERSION",
    "PROBE_SHAPES",
    "Absent",
    "AdaptedReducers",
    "CollectionRecord",
    "ErrorRecord",
    "HistogramRecord",
    "LearnedNames",
    "LegacySink",
    "ModuleCallRecord",
    "ModuleRecord",
    "ReducerRecord",
    "RunRecord",
    "SampleRecord",
    "SampleState",
    "SamplingRecord",
    "TensorRecord",
    "adapt_reducers",
    "adapt_sinks",
    "is_legacy_reducer",
    "is_legacy_sink",
    "legacy_path",
    "record_types",
]
