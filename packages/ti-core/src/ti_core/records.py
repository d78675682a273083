"""Columnar ``ti.history`` / ``ti.histograms`` record batches built from numpy arrays.

One Python object per measured *tensor* (its :class:`Entry`), none per row: identity columns are
repeated per metric with ``take``, values come straight from the reducers' float64 matrix.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa

from ti_core.reduction.histograms import HistogramData

SignalName = Literal[
    "output", "output_gradient", "parameter", "parameter_gradient", "parameter_update"
]
"""Values of the ``signal`` column (``ti_schema.SIGNALS``)."""


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
        self, signal: SignalName, entries: Sequence[Entry], repeat: int
    ) -> tuple[list[pa.Array], np.ndarray]:
        """Columns that depend only on the entries' identity (all but timestamp, sample and
        forward index), ``repeat`` rows per entry, and the row-to-entry index."""
        key = (
            signal,
            repeat,
            tuple(
                (e.layer, e.call_index, e.path, e.train, e.grad_enabled, e.shape, e.dtype)
                for e in entries
            ),
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
    signal: SignalName,
    sample_id: int,
    forward_index: int,
    entries: Sequence[Entry],
    repeat: int,
) -> list[pa.Array]:
    rows = len(entries) * repeat
    static, rep = run.static_columns(signal, entries, repeat)
    run_id, rank, layer, module_type, call, signal_col, path, mode, grad, shapes, dtype = static
    stamps = np.fromiter((e.timestamp_us for e in entries), dtype=np.int64, count=len(entries))
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
    run: RunColumns, signal: SignalName, entries: Sequence[Entry], repeat: int
) -> tuple[list[pa.Array], np.ndarray]:
    n = len(entries)
    rows = n * repeat
    rep = np.repeat(np.arange(n, dtype=np.int64), repeat)
    layer = np.fromiter((e.layer for e in entries), dtype=np.int64, count=n)[rep]
    call = np.fromiter((e.call_index for e in entries), dtype=np.int32, count=n)[rep]
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
    signal: SignalName,
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
    signal: SignalName,
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


def _concat(parts: list[np.ndarray], dtype: type[np.generic]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def histogram_batch(
    run: RunColumns,
    signal: SignalName,
    sample_id: int,
    forward_index: int,
    entries: Sequence[Entry],
    histograms: Sequence[HistogramData],
) -> pa.RecordBatch:
    """One ``ti.histograms`` row per entry."""
    limits = [np.asarray(h.bucket_limits, dtype=np.float64) for h in histograms]
    counts = [np.asarray(h.bucket_counts, dtype=np.int64) for h in histograms]
    limit_offsets = np.zeros(len(histograms) + 1, dtype=np.int32)
    np.cumsum([v.size for v in limits], out=limit_offsets[1:])
    count_offsets = np.zeros(len(histograms) + 1, dtype=np.int32)
    np.cumsum([c.size for c in counts], out=count_offsets[1:])
    heads = np.array(
        [
            (
                math.nan if h.min is None else h.min,
                math.nan if h.max is None else h.max,
                h.num,
                h.sum,
                h.sum_squares,
                h.nonfinite_count,
            )
            for h in histograms
        ],
        dtype=np.float64,
    ).reshape(len(histograms), 6)
    no_range = np.array([h.min is None for h in histograms], dtype=np.bool_)
    columns = [
        *_identity(run, signal, sample_id, forward_index, entries, 1),
        pa.ListArray.from_arrays(pa.array(limit_offsets), pa.array(_concat(limits, np.float64))),
        pa.ListArray.from_arrays(pa.array(count_offsets), pa.array(_concat(counts, np.int64))),
        pa.array(heads[:, 0], pa.float64(), mask=no_range),
        pa.array(heads[:, 1], pa.float64(), mask=no_range),
        pa.array([int(h.num) for h in histograms], pa.int64()),
        pa.array(heads[:, 3]),
        pa.array(heads[:, 4]),
        pa.array([int(h.nonfinite_count) for h in histograms], pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=run.histogram_schema)
