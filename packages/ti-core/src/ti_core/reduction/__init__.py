"""The reduction: tensors in, exact metric values and histograms out, and where that happens.

Knows nothing of hooks, samples, emission or sinks (docs/metrics.md defines what it
computes). Modules, from the entry points down:

- :mod:`~ti_core.reduction.plan`: ``Reducer``, ``DefaultProfile``, ``ReductionPlan`` (validated
  reducers; batches a call's tensors by device and size) and ``Measurements`` (its result).
- :mod:`~ti_core.reduction.histograms`: ``compute_histograms`` and ``HistogramData``.
- :mod:`~ti_core.reduction.numpy_rows` / :mod:`~ti_core.reduction.numpy_histograms`: the numpy
  engine (CPU tensors): profile rows, and histogram rows from what the reduction learned.
- :mod:`~ti_core.reduction.torch_rows` / :mod:`~ti_core.reduction.torch_select`: the torch
  engine (accelerator tensors, on their device): profile rows, exact selection and sums.
- :mod:`~ti_core.reduction.layout`: the columns of a profile row and of a histogram row.
- :mod:`~ti_core.reduction.quantiles`, :mod:`~ti_core.reduction.bands`: the quartile
  definition and the sample-placed bands both engines share.
- :mod:`~ti_core.reduction.support`: supported dtypes, which engine, exact float views.
- :mod:`~ti_core.reduction.batch`: one signal's snapshots (``TensorBatch``), filled by capture
  and reduced once by :meth:`~ti_core.reduction.batch.TensorBatch.finish`, with recycled
  buffers (:mod:`~ti_core.reduction.snapshots`) and the local parts of DTensors and other
  subclasses (:mod:`~ti_core.reduction.sharding`).
- :mod:`~ti_core.reduction.ended`: the hand-over of a complete batch from capture to emission
  (``EndedSignal``, ``SignalTarget``).
- :mod:`~ti_core.reduction.placement`: where, and on which thread, each tensor is reduced.
"""

from __future__ import annotations

from ti_core.reduction.histograms import DEFAULT_BINS, HistogramData, compute_histograms
from ti_core.reduction.plan import (
    DefaultProfile,
    Measurements,
    Reducer,
    ReducerSpec,
    ReductionPlan,
    default_reducers,
)

__all__ = [
    "DEFAULT_BINS",
    "DefaultProfile",
    "HistogramData",
    "Measurements",
    "Reducer",
    "ReducerSpec",
    "ReductionPlan",
    "compute_histograms",
    "default_reducers",
]
