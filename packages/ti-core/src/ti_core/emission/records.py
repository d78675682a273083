"""Columnar ``ti.history`` / ``ti.histograms`` record batches built from numpy arrays.

No Python object per row, and none per measured tensor on the capture path: capture appends
each tensor's identity and context to the columns of an :class:`Entries`; identity columns are
repeated per metric with ``take``, values come straight from the reducers' float64 matrix.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ti_core.entries import Entries, Entry, as_entries
from ti_core.reduction import layout
from ti_core.reduction.histograms import HistogramRows, single_value_limit
from ti_schema import Signal


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
        object.__setattr__(self, "_static", {})
        object.__setattr__(self, "_static_lock", threading.Lock())

    layer_objects: np.ndarray = field(init=False)
    module_type_objects: np.ndarray = field(init=False)
    metric_objects: np.ndarray = field(init=False)
    # Static identity columns of recent entry lists (a training loop repeats the same layers,
    # calls, shapes and dtypes every sample); bounded, shared by the threads that emit.
    _static: dict[tuple[object, ...], list[pa.Array]] = field(init=False, repr=False, compare=False)
    _static_lock: threading.Lock = field(init=False, repr=False, compare=False)

    def metric_column(self, entries: int) -> pa.Array:
        """The ``metric`` column of ``entries`` entries (metrics in the run's order)."""
        key: tuple[object, ...] = ("metric", entries)
        with self._static_lock:
            hit = self._static.get(key)
        if hit is not None:
            return hit[0]
        n_metrics = len(self.metric_names)
        index = np.tile(np.arange(n_metrics, dtype=np.int64), entries)
        column = _strings(self.metric_objects, index)
        with self._static_lock:
            if len(self._static) >= _STATIC_MAX:
                self._static.pop(next(iter(self._static)))
            self._static[key] = [column]
        return column

    def static_columns(
        self, signal: Signal, entries: Entries, repeat: int
    ) -> tuple[list[pa.Array], np.ndarray]:
        """Columns that depend only on the entries' identity (all but timestamp, sample and
        forward index), ``repeat`` rows per entry, and the row-to-entry index."""
        key: tuple[object, ...] = (
            (signal, repeat, entries.key)
            if entries.key is not None
            else self._content_key(signal, entries, repeat)
        )
        with self._static_lock:
            hit = self._static.get(key)
        if hit is not None:
            return hit[:-1], hit[-1].to_numpy()
        columns, rep = _static_columns(self, signal, entries, repeat)
        with self._static_lock:
            if len(self._static) >= _STATIC_MAX:
                self._static.pop(next(iter(self._static)))
            self._static[key] = [*columns, pa.array(rep)]
        return columns, rep

    @staticmethod
    def _content_key(signal: Signal, entries: Entries, repeat: int) -> tuple[object, ...]:
        return (
            signal,
            repeat,
            tuple(entries.layer),
            tuple(entries.call_index),
            tuple(entries.path),
            tuple(entries.train),
            tuple(entries.grad_enabled),
            tuple(entries.shape),
            tuple(entries.dtype),
        )


_TIMESTAMP = pa.timestamp("us", tz="UTC")
_MODE_NAMES = np.array(["eval", "train"], dtype=object)
_STATIC_MAX = 16
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
    signal: Signal,
    sample_id: int,
    forward_index: int,
    entries: Entries,
    repeat: int,
) -> list[pa.Array]:
    rows = len(entries) * repeat
    static, rep = run.static_columns(signal, entries, repeat)
    run_id, rank, layer, module_type, call, signal_col, path, mode, grad, shapes, dtype = static
    stamps = np.asarray(entries.timestamp_us, dtype=np.int64)
    return [
        run_id,
        rank,
        pa.array(np.full(rows, sample_id, dtype=np.int64)),
        pa.array(np.full(rows, forward_index, dtype=np.int64)),
        pa.array(stamps[rep] if repeat > 1 else stamps).view(_TIMESTAMP),
        layer,
        module_type,
        call,
        signal_col,
        path,
        mode,
        grad,
        shapes,
        dtype,
    ]


def _static_columns(
    run: RunColumns, signal: Signal, entries: Entries, repeat: int
) -> tuple[list[pa.Array], np.ndarray]:
    n = len(entries)
    rows = n * repeat
    rep = np.repeat(np.arange(n, dtype=np.int64), repeat)
    layer = np.asarray(entries.layer, dtype=np.int64)[rep]
    call = np.asarray(entries.call_index, dtype=np.int32)[rep]
    train = np.asarray(entries.train, dtype=np.int64)[rep]
    grad = np.asarray(entries.grad_enabled, dtype=np.bool_)[rep]
    lengths = np.fromiter(map(len, entries.shape), dtype=np.int64, count=n)
    dims = np.fromiter(
        (d for shape in entries.shape for d in shape), dtype=np.int64, count=int(lengths.sum())
    )
    # each entry's dims repeated ``repeat`` times, with offsets over the repeated rows
    row_lengths = lengths[rep]
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(row_lengths, out=offsets[1:])
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    gather = np.repeat(starts[rep] - offsets[:-1], row_lengths) + np.arange(offsets[-1])
    shapes = pa.ListArray.from_arrays(pa.array(offsets), pa.array(dims[gather], pa.int64()))
    paths = np.array(entries.path, dtype=object)
    dtypes = np.array(entries.dtype, dtype=object)
    columns = [
        constant_strings(run.run_id, rows),
        pa.array(np.full(rows, run.rank, dtype=np.int32)),
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
    return columns, rep


def history_batch(
    run: RunColumns,
    signal: Signal,
    sample_id: int,
    forward_index: int,
    entries: Entries | Sequence[Entry],
    values: np.ndarray,
    available: np.ndarray,
    reasons: Sequence[Sequence[str | None]],
) -> pa.RecordBatch:
    """``len(entries) * n_metrics`` rows: entry-major, metrics in the run's order.

    ``value`` is null exactly where ``available`` is False (or the value is NaN); the reason is
    then the reducer's, or a generic one if it gave none.
    """
    entries = as_entries(entries)
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
    metric = run.metric_column(n)
    columns = [
        *_identity(run, signal, sample_id, forward_index, entries, n_metrics),
        metric,
        value_col,
        reason_col,
    ]
    return pa.RecordBatch.from_arrays(columns, schema=run.history_schema)


def unavailable_batch(
    run: RunColumns,
    signal: Signal,
    sample_id: int,
    forward_index: int,
    entries: Entries | Sequence[Entry],
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


def histogram_batch(
    run: RunColumns,
    signal: Signal,
    sample_id: int,
    forward_index: int,
    entries: Entries | Sequence[Entry],
    histograms: HistogramRows,
) -> pa.RecordBatch:
    """One ``ti.histograms`` row per entry."""
    entries = as_entries(entries)
    limits, counts, offsets, heads, num, nonfinite = _histogram_lists(histograms)
    no_range = num == 0
    columns = [
        *_identity(run, signal, sample_id, forward_index, entries, 1),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(limits, pa.float64())),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(counts, pa.int64())),
        pa.array(heads[:, 0], pa.float64(), mask=no_range),
        pa.array(heads[:, 1], pa.float64(), mask=no_range),
        pa.array(num, pa.int64()),
        pa.array(heads[:, 3]),
        pa.array(heads[:, 4]),
        pa.array(nonfinite, pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=run.histogram_schema)


_Lists = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Bucket limits, bucket counts and the list offsets they share, the (k, 6) heads (min, max,
num, sum, sum of squares, non-finite), num and non-finite counts as int64."""


def _histogram_lists(histograms: HistogramRows) -> _Lists:
    """The columns of ``histograms`` from its matrix, as :class:`HistogramData` would give them
    (empty histograms have no bucket and zero sums; a single-valued one has one bucket)."""
    rows, bins = histograms.rows, histograms.bins
    k = len(rows)
    heads = rows[:, : layout.HISTOGRAM_HEAD].copy()
    num = heads[:, layout.H_NUM].astype(np.int64)
    nonfinite = heads[:, layout.H_NONFINITE].astype(np.int64)
    empty = num == 0
    heads[empty, layout.H_SUM] = 0.0
    heads[empty, layout.H_SUM_SQUARES] = 0.0
    single = ~empty & (heads[:, layout.H_MIN] == heads[:, layout.H_MAX])
    edges = layout.histogram_edges(bins)
    limits = rows[:, edges.start + 1 : edges.stop].copy()
    counts = rows[:, layout.histogram_counts(bins)].astype(np.int64)
    for r in np.flatnonzero(single).tolist():
        limits[r, 0] = single_value_limit(float(heads[r, layout.H_MAX]))
        counts[r, 0] = num[r]
    lengths = np.where(empty, 0, np.where(single, 1, bins))
    offsets = np.zeros(k + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    kept = np.arange(bins)[None, :] < lengths[:, None]
    return limits[kept], counts[kept], offsets, heads, num, nonfinite


__all__ = [
    "Entry",
    "RunColumns",
    "constant_strings",
    "histogram_batch",
    "history_batch",
    "unavailable_batch",
]
