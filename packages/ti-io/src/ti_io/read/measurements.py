"""Every measurement's aggregates of one history, in memory that does not grow with the history.

The one aggregation behind result.json (finalization, ``ti consolidate``, ``ti upgrade``) and
``ti summary`` (finalized or live). :class:`Measurements` is fed the history's row groups in
order (:mod:`ti_io.read.row_groups`) and does three things with each:

1. gives every row its measurement's id (:class:`~ti_io.read.keys.KeyCatalog`);
2. routes the compact columns ``key, row, sample_id, value`` to the partition of its
   measurement (:class:`~ti_io.read.spill.Partitions`: on disk when the history is long);
3. counts the unavailable rows by reason, and the sample ids and times seen (small).

:meth:`Measurements.aggregated` then aggregates one partition at a time with Polars
(:mod:`ti_io.read.aggregates`: exact quartiles and window means, since a partition holds
every value of its measurements), and reads the few rows that hold each
measurement's latest shape and dtype and first module type from the history again
(``fetch``), instead of carrying those columns for every row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from ti_io.progress import ProgressCallback, Steps
from ti_io.read.aggregates import TAIL, tail_expr, value_exprs, window_exprs
from ti_io.read.keys import KeyCatalog
from ti_io.read.ordering import GROUP_KEYS
from ti_io.read.row_groups import HistoryFiles, read_row_groups, read_rows
from ti_io.read.spill import Partitions, partition_count

COLUMNS: Final[tuple[str, ...]] = (*GROUP_KEYS, "sample_id", "value", "unavailable_reason")
"""The ``ti.history`` columns :meth:`Measurements.add` reads (``timestamp`` too when present)."""
FACT_COLUMNS: Final[tuple[str, ...]] = ("shape", "dtype", "module_type")
"""Read again for one row per measurement (``fetch``)."""

SPILL_SCHEMA: Final[pa.Schema] = pa.schema(
    [
        pa.field("key", pa.uint32(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("value", pa.float64()),
    ]
)

_SPILL_DTYPES: Final[tuple[pl.DataType, ...]] = (pl.UInt32(), pl.Int64(), pl.Int64(), pl.Float64())

Fetch = Callable[[Sequence[int], Sequence[str]], pa.Table]
"""``fetch(rows, columns)``: the rows numbered ``rows`` (in the order the history was fed)
with ``columns``, in that order."""


class Measurements:
    """Per-measurement aggregates of a ``ti.history`` stream (module docstring); a context
    manager that removes its partition files on exit.

    ``expected_rows``: the history's rows (from its footers), which sets how many partitions
    are used. ``keep``: decides per measurement (its ``GROUP_KEYS`` tuple) whether its rows
    count (a reader's ``--layer`` / ``--metric`` selection). ``directory``: where partitions
    are written (None: the system's temporary directory).
    """

    def __init__(
        self,
        expected_rows: int,
        *,
        keep: Callable[[tuple[Any, ...]], bool] | None = None,
        directory: Path | None = None,
    ) -> None:
        self.catalog = KeyCatalog(GROUP_KEYS, keep)
        self._partitions = Partitions(SPILL_SCHEMA, partition_count(expected_rows), directory)
        self._reasons: Counter[tuple[int, str]] = Counter()
        self._samples: list[npt.NDArray[np.int64]] = []
        self._times: list[tuple[datetime, datetime]] = []
        self._aggregated: pl.DataFrame | None = None
        self._in_order = True
        self._last_sample: int | None = None
        self.rows = 0
        """Rows fed (kept or not)."""

    def __enter__(self) -> Measurements:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._partitions.close()

    @property
    def partitioned_rows(self) -> int:
        """Rows kept (routed into the partitions)."""
        return self._partitions.rows

    def add(self, table: pa.Table) -> None:
        """Fold the next rows of the history (a ``ti.history`` table with at least
        :data:`COLUMNS`; strings plain or dictionary-encoded)."""
        rows = table.num_rows
        if not rows:
            return
        if self._aggregated is not None:
            raise RuntimeError("Measurements.add after aggregated(): feed every row first")
        ids = self.catalog.ids(table.select(list(GROUP_KEYS)))
        numbers = np.arange(self.rows, self.rows + rows, dtype=np.int64)
        self.rows += rows
        sample_ids = table.column("sample_id").combine_chunks()
        self._samples.append(pc.unique(sample_ids).to_numpy())
        self._follow_order(sample_ids)
        if "timestamp" in table.column_names and rows:
            low, high = pc.min_max(table.column("timestamp")).values()
            if low.is_valid:
                self._times.append((low.as_py(), high.as_py()))
        value = table.column("value").combine_chunks()
        kept = self.catalog.kept
        if not kept.all():
            mask = kept[ids]
            if not mask.any():
                return
            ids, numbers = ids[mask], numbers[mask]
            chosen = pa.array(mask)
            sample_ids, value = sample_ids.filter(chosen), value.filter(chosen)
            table = table.filter(chosen)
        if value.null_count:
            self._count_reasons(ids, value, table.column("unavailable_reason"))
        self._partitions.add(
            pa.record_batch(
                [pa.array(ids), pa.array(numbers), sample_ids, value.cast(pa.float64())],
                schema=SPILL_SCHEMA,
            )
        )

    def _follow_order(self, sample_ids: pa.Array) -> None:
        """Note whether the rows still arrive in sample-id order (:func:`_statistics`)."""
        if not self._in_order or not len(sample_ids):
            return
        ids = sample_ids.to_numpy(zero_copy_only=False)
        before = self._last_sample is not None and ids[0] < self._last_sample
        if before or (len(ids) > 1 and bool((ids[1:] < ids[:-1]).any())):
            self._in_order = False
        self._last_sample = int(ids[-1])

    def _count_reasons(
        self, ids: npt.NDArray[np.uint32], value: pa.Array, reasons: pa.ChunkedArray
    ) -> None:
        missing = pc.is_null(value)
        frame = pl.DataFrame(
            {
                "key": ids[missing.to_numpy(zero_copy_only=False)],
                "reason": pl.Series(reasons.filter(missing).cast(pa.string())),
            }
        )
        for key, reason, count in frame.group_by("key", "reason").len().iter_rows():
            self._reasons[(int(key), reason or "")] += int(count)

    def aggregated(
        self,
        window: int,
        fetch: Fetch | None = None,
        on_partition: Callable[[int], None] | None = None,
    ) -> pl.DataFrame:
        """One row per kept measurement: the ``GROUP_KEYS`` columns, every result.json
        aggregate (``observations``, ``unavailable``, ``mean`` ... ``previous_window_mean``,
        ``recent_window_mean``), ``rows``, ``latest_sample`` and ``latest`` (the value at it),
        ``first_reason`` (the most frequent unavailable reason) and ``reasons`` (how many), and
        with ``fetch`` ``latest_shape``, ``dtype`` and ``module_type``. Computed once; the
        partitions are consumed. ``on_partition(rows)`` after each partition is aggregated."""
        if self._aggregated is None:
            self._aggregated = self._aggregate(window, fetch, on_partition)
        return self._aggregated

    @property
    def result(self) -> pl.DataFrame | None:
        """What :meth:`aggregated` returned (None before it was called)."""
        return self._aggregated

    def _aggregate(
        self, window: int, fetch: Fetch | None, on_partition: Callable[[int], None] | None
    ) -> pl.DataFrame:
        in_order = self._in_order
        frames = []
        for frame in self._partitions.frames():
            frames.append(_statistics(frame, window, in_order=in_order))
            if on_partition is not None:
                on_partition(frame.height)
        self._partitions.close()
        if not frames:
            empty = pl.DataFrame(schema=dict(zip(SPILL_SCHEMA.names, _SPILL_DTYPES, strict=True)))
            frames = [_statistics(empty, window, in_order=True)]
        stats = pl.concat(frames)
        table = self.catalog.frame().join(stats, on="key", how="inner")
        return self._facts(table, fetch).join(self._reason_frame(), on="key", how="left")

    def _reason_frame(self) -> pl.DataFrame:
        ranked = sorted(self._reasons.items(), key=lambda item: (-item[1], item[0][1]))
        first: dict[int, str] = {}
        count: Counter[int] = Counter()
        for (key, reason), _ in ranked:
            first.setdefault(key, reason)
            count[key] += 1
        return pl.DataFrame(
            {
                "key": pl.Series(list(first), dtype=pl.UInt32),
                "first_reason": pl.Series([first[k] for k in first], dtype=pl.String),
                "reasons": pl.Series([count[k] for k in first], dtype=pl.UInt32),
            }
        )

    def _facts(self, table: pl.DataFrame, fetch: Fetch | None) -> pl.DataFrame:
        if fetch is None:
            return table
        latest = table.get_column("_latest_row").to_list()
        first = table.get_column("_first_row").to_list()
        facts = fetch(latest + first, FACT_COLUMNS)
        n = len(latest)
        return table.with_columns(
            pl.Series("latest_shape", facts.column("shape").slice(0, n)),
            pl.Series("dtype", facts.column("dtype").slice(0, n).cast(pa.string())),
            pl.Series("module_type", facts.column("module_type").slice(n).cast(pa.string())),
        )

    @property
    def reasons(self) -> Counter[tuple[int, str]]:
        """Unavailable rows by (measurement id, reason)."""
        return self._reasons

    def samples(self) -> npt.NDArray[np.int64]:
        """Every sample id seen, ascending (one per sample: small beside the rows)."""
        if not self._samples:
            return np.array([], dtype=np.int64)
        return np.unique(np.concatenate(self._samples))

    def time_span(self) -> tuple[datetime | None, datetime | None]:
        """The first and last ``timestamp`` seen (None when no row had one)."""
        if not self._times:
            return None, None
        return min(t[0] for t in self._times), max(t[1] for t in self._times)


def _statistics(frame: pl.DataFrame, window: int, *, in_order: bool) -> pl.DataFrame:
    """The aggregates of every measurement of one partition (every value of each is there).

    The windows and the latest value read each measurement's rows in sample order:
    ``in_order`` says the history arrived in sample-id order (then so did each measurement's
    rows, since partitions keep the arrival order); otherwise the partition is sorted by
    measurement and sample id first (stably: rows of one sample keep their order).
    """
    if not in_order:
        frame = frame.sort("key", "sample_id", maintain_order=True)
    return (
        frame.lazy()
        .group_by("key")
        .agg(
            *value_exprs(),
            tail_expr(window),
            pl.len().alias("rows"),
            pl.col("sample_id").last().alias("latest_sample"),
            pl.col("value").last().alias("latest"),
            pl.col("row").last().alias("_latest_row"),
            pl.col("row").min().alias("_first_row"),
        )
        .with_columns(window_exprs(window))
        .drop(TAIL)
        .collect()
    )


def aggregate_files(
    files: HistoryFiles,
    window: int,
    keep: Callable[[tuple[Any, ...]], bool] | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[pl.DataFrame, KeyCatalog]:
    """The aggregates of :meth:`Measurements.aggregated` (with the facts) of the history
    ``files``, read once a row group at a time; and the catalog of every measurement seen
    (kept or not). ``progress(done, total)``: rows read, then rows aggregated (total: twice
    the rows)."""
    steps = Steps(progress, 2 * files.total_rows)
    with Measurements(files.total_rows, keep=keep) as measurements:
        for group in read_row_groups(files.paths, COLUMNS):
            measurements.add(group.table)
            steps.advance(group.table.num_rows)
        steps.advance(files.total_rows - measurements.partitioned_rows)  # rows not kept

        def fetch(rows: Sequence[int], columns: Sequence[str]) -> pa.Table:
            return read_rows(files, rows, columns)

        table = measurements.aggregated(window, fetch, steps.advance)
        return table, measurements.catalog


__all__ = ["COLUMNS", "FACT_COLUMNS", "Fetch", "Measurements", "aggregate_files"]
