"""Columnar ``ti.history`` / ``ti.histograms`` record batches built from numpy arrays.

No Python object per row, and none per measured tensor on the capture path: capture appends
each tensor's identity and context to the columns of an :class:`Entries`; identity columns are
repeated per metric with ``take``, values come straight from the reducers' float64 matrix.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Literal

import numpy as np
import pyarrow as pa

from ti_core.reduction import layout
from ti_core.reduction.histograms import HistogramData, HistogramRows, single_value_limit

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


class Entries:
    """Identity and context of measured tensors, one list per :class:`Entry` field.

    What the record batches are built from: column ``f`` of row ``i`` is field ``f`` of the
    ``i``-th measured tensor. Capture records rows (``ti_core.capture.batch.Row``) and turns
    them into columns once per signal.
    """

    __slots__ = (
        "call_index",
        "dtype",
        "grad_enabled",
        "key",
        "layer",
        "path",
        "shape",
        "timestamp_us",
        "train",
    )

    def __init__(self) -> None:
        self.layer: list[int] = []
        self.call_index: list[int] = []
        self.path: list[str] = []
        self.train: list[bool] = []
        self.grad_enabled: list[bool] = []
        self.shape: list[tuple[int, ...]] = []
        self.dtype: list[str] = []
        self.timestamp_us: list[int] = []
        self.key: int | None = None
        """Equal for entries whose columns, all but ``timestamp_us``, are equal (None: not
        known). Capture sets it where it reuses the columns of an earlier batch, and the record
        batches then reuse the identity columns built for that key."""

    def __len__(self) -> int:
        return len(self.layer)

    def __getitem__(self, i: int) -> Entry:
        return Entry(
            self.layer[i],
            self.call_index[i],
            self.path[i],
            self.train[i],
            self.grad_enabled[i],
            self.shape[i],
            self.dtype[i],
            self.timestamp_us[i],
        )

    @classmethod
    def of_columns(
        cls,
        layer: list[int],
        call_index: list[int],
        path: list[str],
        train: list[bool],
        grad_enabled: list[bool],
        shape: list[tuple[int, ...]],
        dtype: list[str],
        timestamp_us: list[int],
        key: int | None = None,
    ) -> Entries:
        """Entries from equally long columns (taken, not copied; columns shared under a ``key``
        are never changed)."""
        lengths = {len(c) for c in (layer, call_index, path, train, grad_enabled, shape, dtype)}
        if lengths != {len(timestamp_us)}:
            raise ValueError(f"entry columns differ in length: {sorted(lengths)}")
        out = cls()
        out.layer, out.call_index, out.path, out.train = layer, call_index, path, train
        out.grad_enabled, out.shape, out.dtype = grad_enabled, shape, dtype
        out.timestamp_us = timestamp_us
        out.key = key
        return out

    @classmethod
    def of(cls, entries: Iterable[Entry]) -> Entries:
        """The columns of ``entries``."""
        out = cls()
        for e in entries:
            out.append(e)
        return out

    def append(self, e: Entry) -> None:
        """Add ``e`` as the last row."""
        self.layer.append(e.layer)
        self.call_index.append(e.call_index)
        self.path.append(e.path)
        self.train.append(e.train)
        self.grad_enabled.append(e.grad_enabled)
        self.shape.append(e.shape)
        self.dtype.append(e.dtype)
        self.timestamp_us.append(e.timestamp_us)

    def take(self, rows: Sequence[int]) -> Entries:
        """The entries at ``rows``, in that order."""
        out = Entries()
        if not rows:
            return out
        get = itemgetter(*rows)
        for name in _COLUMNS:
            picked = get(getattr(self, name))
            setattr(out, name, list(picked) if len(rows) > 1 else [picked])
        return out


_COLUMNS = tuple(name for name in Entries.__slots__ if name != "key")


class Gaps:
    """Outputs whose gradient cannot be captured: their entries and the reason for each."""

    __slots__ = ("entries", "reasons")

    def __init__(self) -> None:
        self.entries = Entries()
        self.reasons: list[str] = []

    def __len__(self) -> int:
        return len(self.reasons)

    def add(self, entry: Entry, reason: str) -> None:
        """``entry`` has no capturable gradient, because ``reason``."""
        self.entries.append(entry)
        self.reasons.append(reason)


def as_entries(entries: Entries | Sequence[Entry]) -> Entries:
    """``entries`` as columns (a sequence of :class:`Entry` is converted)."""
    return entries if isinstance(entries, Entries) else Entries.of(entries)


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
        self, signal: SignalName, entries: Entries, repeat: int
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
    def _content_key(signal: SignalName, entries: Entries, repeat: int) -> tuple[object, ...]:
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
    signal: SignalName,
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
    run: RunColumns, signal: SignalName, entries: Entries, repeat: int
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
    signal: SignalName,
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
    signal: SignalName,
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


def _concat(parts: list[np.ndarray], dtype: type[np.generic]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def histogram_batch(
    run: RunColumns,
    signal: SignalName,
    sample_id: int,
    forward_index: int,
    entries: Entries | Sequence[Entry],
    histograms: HistogramRows | Sequence[HistogramData],
) -> pa.RecordBatch:
    """One ``ti.histograms`` row per entry."""
    entries = as_entries(entries)
    if isinstance(histograms, HistogramRows):
        lists = _histogram_lists(histograms)
    else:
        lists = _histogram_data_lists(histograms)
    limits, limit_offsets, counts, count_offsets, heads, num, nonfinite = lists
    no_range = num == 0
    columns = [
        *_identity(run, signal, sample_id, forward_index, entries, 1),
        pa.ListArray.from_arrays(pa.array(limit_offsets), pa.array(limits, pa.float64())),
        pa.ListArray.from_arrays(pa.array(count_offsets), pa.array(counts, pa.int64())),
        pa.array(heads[:, 0], pa.float64(), mask=no_range),
        pa.array(heads[:, 1], pa.float64(), mask=no_range),
        pa.array(num, pa.int64()),
        pa.array(heads[:, 3]),
        pa.array(heads[:, 4]),
        pa.array(nonfinite, pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=run.histogram_schema)


_Lists = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Bucket limits and their offsets, counts and theirs, the (k, 6) heads (min, max, num, sum,
sum of squares, non-finite), num and non-finite counts as int64."""


def _histogram_data_lists(histograms: Sequence[HistogramData]) -> _Lists:
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
    num = np.array([int(h.num) for h in histograms], dtype=np.int64)
    nonfinite = np.array([int(h.nonfinite_count) for h in histograms], dtype=np.int64)
    return (
        _concat(limits, np.float64),
        limit_offsets,
        _concat(counts, np.int64),
        count_offsets,
        heads,
        num,
        nonfinite,
    )


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
    return limits[kept], offsets, counts[kept], offsets, heads, num, nonfinite
