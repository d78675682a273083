"""Columnar ``ti.history`` / ``ti.histograms`` record batches built from numpy arrays.

One Python object per measured *tensor* (its :class:`Entry`), none per row: identity columns are
repeated per metric with ``take``, values come straight from the reducers' float64 matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from ti_core.histograms import HistogramData


@dataclass(frozen=True, slots=True)
class Entry:
    """Identity and context of one measured tensor."""

    layer: int
    """Index into the run's layers."""
    call_index: int
    path: str
    train: bool
    grad_enabled: bool
    shape: tuple[int, ...]
    dtype: str
    timestamp_us: int


@dataclass(frozen=True)
class RunColumns:
    """Per-run constants the batches are built from, prepared once at attach."""

    history_schema: pa.Schema
    histogram_schema: pa.Schema
    run_id: str
    rank: int
    layer_names: Sequence[str]
    module_types: Sequence[str]
    metric_names: Sequence[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_objects", np.array(self.layer_names, dtype=object))
        object.__setattr__(self, "module_type_objects", np.array(self.module_types, dtype=object))
        object.__setattr__(self, "metric_objects", np.array(self.metric_names, dtype=object))

    layer_objects: np.ndarray = field(init=False)
    module_type_objects: np.ndarray = field(init=False)
    metric_objects: np.ndarray = field(init=False)


_TIMESTAMP = pa.timestamp("us", tz="UTC")
_MODE_NAMES = np.array(["eval", "train"], dtype=object)
_SMALL = 512
"""Below this many rows, string columns are built from numpy object arrays (pyarrow's ``take``
has a fixed dispatch cost); above it, ``take`` on the per-entry array is faster."""


def constant_strings(value: str, rows: int) -> pa.Array:
    """``rows`` copies of ``value`` built directly from buffers."""
    data = value.encode()
    if rows * len(data) < 2**31:
        offsets = np.arange(rows + 1, dtype=np.int32) * np.int32(len(data))
        return pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(data * rows))
    wide = np.arange(rows + 1, dtype=np.int64) * len(data)
    large = pa.LargeStringArray.from_buffers(rows, pa.py_buffer(wide), pa.py_buffer(data * rows))
    return large.cast(pa.string())


def _strings(values: np.ndarray, index: np.ndarray) -> pa.Array:
    """``values[index]`` (an object array of str) as an Arrow string array."""
    if len(index) < _SMALL:
        return pa.array(values[index], pa.string())
    return pa.array(values, pa.string()).take(pa.array(index))


def _identity(
    run: RunColumns,
    signal: str,
    sample_id: int,
    forward_index: int,
    entries: Sequence[Entry],
    repeat: int,
) -> list[pa.Array]:
    n = len(entries)
    rows = n * repeat
    rep = np.repeat(np.arange(n, dtype=np.int64), repeat)
    layer = np.fromiter((e.layer for e in entries), dtype=np.int64, count=n)[rep]
    call = np.fromiter((e.call_index for e in entries), dtype=np.int32, count=n)[rep]
    stamp = np.fromiter((e.timestamp_us for e in entries), dtype=np.int64, count=n)[rep]
    train = np.fromiter((e.train for e in entries), dtype=np.int64, count=n)[rep]
    grad = np.fromiter((e.grad_enabled for e in entries), dtype=np.bool_, count=n)[rep]
    lengths = np.fromiter((len(e.shape) for e in entries), dtype=np.int64, count=n)
    dims = np.fromiter(
        (d for e in entries for d in e.shape), dtype=np.int64, count=int(lengths.sum())
    )
    # each entry's dims repeated ``repeat`` times, with offsets over the repeated rows
    row_lengths = lengths[rep]
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(row_lengths, out=offsets[1:])
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    gather = np.repeat(starts[rep] - offsets[:-1], row_lengths) + np.arange(offsets[-1])
    shapes = pa.ListArray.from_arrays(pa.array(offsets), pa.array(dims[gather], pa.int64()))
    paths = np.array([e.path for e in entries], dtype=object)
    dtypes = np.array([e.dtype for e in entries], dtype=object)
    return [
        constant_strings(run.run_id, rows),
        pa.array(np.full(rows, run.rank, dtype=np.int32)),
        pa.array(np.full(rows, sample_id, dtype=np.int64)),
        pa.array(np.full(rows, forward_index, dtype=np.int64)),
        pa.array(stamp).view(_TIMESTAMP),
        _strings(run.layer_objects, layer),
        _strings(run.module_type_objects, layer),
        pa.array(call),
        constant_strings(signal, rows),
        _strings(paths, rep),
        _strings(_MODE_NAMES, train),
        pa.array(grad),
        shapes,
        _strings(dtypes, rep),
    ]


def history_batch(
    run: RunColumns,
    signal: str,
    sample_id: int,
    forward_index: int,
    entries: Sequence[Entry],
    values: np.ndarray,
    available: np.ndarray,
    reasons: Sequence[Sequence[str | None]],
) -> pa.RecordBatch:
    """``len(entries) * n_metrics`` rows: entry-major, metrics in the run's order.

    ``value`` is null exactly where ``available`` is False (or the value is NaN); the reason is
    then the reducer's, or a generic one if it gave none.
    """
    n_metrics = len(run.metric_names)
    n = len(entries)
    values = np.asarray(values, dtype=np.float64).reshape(n, n_metrics)
    missing = ~np.asarray(available, dtype=np.bool_).reshape(n, n_metrics) | np.isnan(values)
    flat_missing = missing.ravel()
    value_col = pa.array(values.ravel(), pa.float64(), mask=flat_missing)
    if not flat_missing.any():
        reason_col = pa.nulls(n * n_metrics, pa.string())
    else:
        flat: list[str | None] = []
        for i in range(n):
            row = reasons[i] if i < len(reasons) else ()
            for j in range(n_metrics):
                if missing[i, j]:
                    given = row[j] if j < len(row) else None
                    flat.append(given or "unavailable: the reducer gave no value")
                else:
                    flat.append(None)
        reason_col = pa.array(flat, pa.string())
    metric = _strings(run.metric_objects, np.tile(np.arange(n_metrics, dtype=np.int64), n))
    columns = [
        *_identity(run, signal, sample_id, forward_index, entries, n_metrics),
        metric,
        value_col,
        reason_col,
    ]
    return pa.RecordBatch.from_arrays(columns, schema=run.history_schema)


def unavailable_batch(
    run: RunColumns,
    signal: str,
    sample_id: int,
    forward_index: int,
    entries: Sequence[Entry],
    reasons: Sequence[str],
) -> pa.RecordBatch:
    """Rows that record a coverage gap: every metric null with the entry's reason."""
    n_metrics = len(run.metric_names)
    shape = (len(entries), n_metrics)
    return history_batch(
        run,
        signal,
        sample_id,
        forward_index,
        entries,
        np.full(shape, np.nan),
        np.zeros(shape, dtype=np.bool_),
        [[r] * n_metrics for r in reasons],
    )


def _optional(value: float | None) -> float | None:
    return None if value is None else float(value)


def histogram_batch(
    run: RunColumns,
    signal: str,
    sample_id: int,
    forward_index: int,
    entries: Sequence[Entry],
    histograms: Sequence[HistogramData],
) -> pa.RecordBatch:
    """One ``ti.histograms`` row per entry."""
    columns = [
        *_identity(run, signal, sample_id, forward_index, entries, 1),
        pa.array(
            [np.asarray(h.bucket_limits, dtype=np.float64) for h in histograms],
            pa.list_(pa.float64()),
        ),
        pa.array(
            [np.asarray(h.bucket_counts, dtype=np.int64) for h in histograms],
            pa.list_(pa.int64()),
        ),
        pa.array([_optional(h.min) for h in histograms], pa.float64()),
        pa.array([_optional(h.max) for h in histograms], pa.float64()),
        pa.array([int(h.num) for h in histograms], pa.int64()),
        pa.array([float(h.sum) for h in histograms], pa.float64()),
        pa.array([float(h.sum_squares) for h in histograms], pa.float64()),
        pa.array([int(h.nonfinite_count) for h in histograms], pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=run.histogram_schema)
