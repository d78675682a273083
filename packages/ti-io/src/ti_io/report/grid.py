"""A run's measurements reduced to what a page can draw, in memory bounded by the page.

One pass over the history, a row group at a time (:mod:`ti_io.read.row_groups`), folds every
row of the chosen panels (a signal and a metric each) into cells: one per tensor and *column*,
a column being a run of consecutive samples (at most ``columns`` of them, equal numbers of
samples each). A cell keeps the minimum, maximum, sum and count of its finite values (the
min/max envelope and the mean of the samples it covers), so the page's size and the reader's
memory grow with tensors x columns, never with the run's length. The same pass keeps each
tensor's latest value and its recent and previous window means (the last ``window`` samples
and the ``window`` before, as result.json defines them) and the forward index of each sample
(where the events go on the time axis).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from ti_io.progress import ProgressCallback, Steps
from ti_io.read.ordering import TENSOR_KEYS, ordered
from ti_io.read.row_groups import HistoryFiles, read_row_groups

READ: Final[tuple[str, ...]] = (*TENSOR_KEYS, "metric", "sample_id", "forward_index", "value")
"""The ``ti.history`` columns the pass reads."""
_FOLD_ROWS: Final[int] = 1 << 18
"""Kept rows aggregated at once (a bounded batch: memory stays flat)."""
_COMPACT_EVERY: Final[int] = 32
"""Partial aggregates of this many row groups are merged into one (memory stays flat)."""

Panel = tuple[str, str]
"""``(signal, metric)``: one heat map of a run."""


@dataclass(frozen=True)
class PanelGrid:
    """One panel of one run: a row per tensor (in the run's order), a column per run of
    samples. Arrays are ``(tensors, columns)``; NaN where a cell holds no finite value."""

    panel: Panel
    tensors: pl.DataFrame
    """One row per tensor: ``TENSOR_KEYS``, ``latest_sample``, ``latest``,
    ``recent_window_mean``, ``previous_window_mean`` (null where no finite value)."""
    mean: npt.NDArray[np.float64]
    low: npt.NDArray[np.float64]
    high: npt.NDArray[np.float64]
    nonzero: bool
    """Whether any finite value of the panel is not 0 (a fraction panel that stayed 0 is not
    drawn)."""


@dataclass(frozen=True)
class RunGrid:
    """Every panel of one run, and where its columns lie on the sample axis."""

    panels: dict[Panel, PanelGrid]
    column_samples: npt.NDArray[np.int64]
    """The first sample id of each column (the x axis)."""
    samples: npt.NDArray[np.int64]
    """Every sample id of the run, ascending."""
    sample_forwards: npt.NDArray[np.int64]
    """The root forward index of each of ``samples``."""
    rows_read: int

    def sample_at_forward(self, forward: int) -> int | None:
        """The last sample taken at or before root forward ``forward`` (None: before the
        first sample)."""
        position = int(np.searchsorted(self.sample_forwards, forward, side="right")) - 1
        return int(self.samples[position]) if position >= 0 else None


def _column_of(samples: npt.NDArray[np.int64], columns: int) -> npt.NDArray[np.int64]:
    """Each sample's column: ``columns`` runs of consecutive samples, equal in size (the last
    ones one sample shorter when they do not divide)."""
    return (np.arange(samples.size, dtype=np.int64) * columns) // max(samples.size, 1)


def _finite(column: str) -> pl.Expr:
    return pl.when(pl.col(column).is_finite()).then(pl.col(column))


_CELL_MERGE: Final[tuple[pl.Expr, ...]] = (
    pl.col("low").min(),
    pl.col("high").max(),
    pl.col("total").sum(),
    pl.col("count").sum(),
)
_TENSOR_MERGE: Final[tuple[pl.Expr, ...]] = (
    pl.col("latest").sort_by("latest_sample").last(),
    pl.col("latest_sample").max(),
    pl.col("recent_total").sum(),
    pl.col("recent_count").sum(),
    pl.col("previous_total").sum(),
    pl.col("previous_count").sum(),
)
_PLAIN: Final[pl.Expr] = pl.col(pl.Categorical).cast(pl.String)
"""Rows are grouped by their dictionary codes; the few aggregated rows get plain strings."""
_KEYS: Final[list[str]] = ["signal", "metric", *(k for k in TENSOR_KEYS if k != "signal")]


class _Folded:
    """Partial aggregates of the row groups read so far, merged every few groups."""

    def __init__(self) -> None:
        self.cells: list[pl.DataFrame] = []
        self.tensors: list[pl.DataFrame] = []
        self.forwards: list[pl.DataFrame] = []

    def add(self, rows: pl.DataFrame) -> None:
        value = _finite("value")
        self.cells.append(
            rows.group_by(*_KEYS, "column")
            .agg(
                value.min().alias("low"),
                value.max().alias("high"),
                value.sum().alias("total"),
                value.count().cast(pl.Int64).alias("count"),
            )
            .with_columns(_PLAIN)
        )
        recent = pl.col("window") == 2
        previous = pl.col("window") == 1
        self.tensors.append(
            rows.group_by(*_KEYS)
            .agg(
                value.sort_by("sample_id").last().alias("latest"),
                pl.col("sample_id").max().alias("latest_sample"),
                value.filter(recent).sum().alias("recent_total"),
                value.filter(recent).count().cast(pl.Int64).alias("recent_count"),
                value.filter(previous).sum().alias("previous_total"),
                value.filter(previous).count().cast(pl.Int64).alias("previous_count"),
            )
            .with_columns(_PLAIN)
        )
        if len(self.cells) >= _COMPACT_EVERY:
            self.compact()

    def add_forwards(self, pairs: pl.DataFrame) -> None:
        self.forwards.append(pairs)
        if len(self.forwards) >= _COMPACT_EVERY:
            self.forwards = [pl.concat(self.forwards).unique()]

    def compact(self) -> None:
        if self.cells:
            self.cells = [pl.concat(self.cells).group_by(*_KEYS, "column").agg(*_CELL_MERGE)]
        if self.tensors:
            latest = pl.concat(self.tensors).sort("latest_sample")
            self.tensors = [latest.group_by(*_KEYS).agg(*_TENSOR_MERGE)]


def read_grid(
    files: HistoryFiles,
    samples: Sequence[int],
    panels: Sequence[Panel],
    *,
    columns: int,
    window: int,
    layers: Sequence[str] = (),
    order: Sequence[str] = (),
    progress: ProgressCallback | None = None,
) -> RunGrid:
    """The panels of one run's history ``files`` (every sample id of it in ``samples``),
    reduced to at most ``columns`` columns (module docstring). ``layers``: the layer names to
    keep (empty: every layer); ``order``: the catalog's layer names (the row order)."""
    ordered_samples = np.unique(np.asarray(samples, dtype=np.int64))
    width = max(1, min(columns, ordered_samples.size))
    column_of = _column_of(ordered_samples, width)
    position = np.arange(ordered_samples.size, dtype=np.int64)
    window_of = np.where(
        position >= ordered_samples.size - window,
        2,
        np.where(position >= ordered_samples.size - 2 * window, 1, 0),
    )
    chosen = set(layers)
    folded = _Folded()
    steps = Steps(progress, files.total_rows)
    signals = {signal for signal, _ in panels}
    metrics = {metric for _, metric in panels}
    exact = (
        None
        if len(signals) * len(metrics) == len(set(panels))
        else pl.any_horizontal(
            (pl.col("signal") == signal) & (pl.col("metric") == metric) for signal, metric in panels
        )
    )
    pending: list[pa.Table] = []
    pending_rows = 0

    def fold() -> None:
        rows = pl.from_arrow(pa.concat_tables(pending, promote_options="permissive"))
        assert isinstance(rows, pl.DataFrame)
        if exact is not None:  # the chosen signals x metrics hold pairs no panel asked for
            rows = rows.filter(exact)
            if rows.is_empty():
                return
        at = np.searchsorted(ordered_samples, rows.get_column("sample_id").to_numpy())
        folded.add(
            rows.with_columns(
                pl.Series("column", column_of[at]), pl.Series("window", window_of[at])
            )
        )

    for group in read_row_groups(files.paths, list(READ)):
        table = group.table
        steps.advance(table.num_rows)
        folded.add_forwards(_sample_forwards(table))
        # Rows of other metrics are dropped before anything is decoded: the dictionaries
        # (a few strings each) are matched, not the rows.
        keep = pc.and_(
            _among(table.column("signal"), signals), _among(table.column("metric"), metrics)
        )
        if chosen:
            keep = pc.and_(keep, _among(table.column("layer"), chosen))
        table = table.filter(keep)
        if table.num_rows:
            pending.append(table)
            pending_rows += table.num_rows
        if pending_rows >= _FOLD_ROWS:  # a few large aggregations, not one per row group
            fold()
            pending, pending_rows = [], 0
    if pending:
        fold()
    folded.compact()
    forwards = (
        pl.concat(folded.forwards).unique().sort("sample_id")
        if folded.forwards
        else pl.DataFrame(schema={"sample_id": pl.Int64, "forward_index": pl.Int64})
    )
    starts = np.searchsorted(column_of, np.arange(width), side="left")
    grids = {
        panel: _panel_grid(panel, folded, width, order)
        for panel in panels
        if folded.tensors and _holds(folded.tensors[0], panel)
    }
    return RunGrid(
        panels=grids,
        column_samples=ordered_samples[starts] if ordered_samples.size else starts,
        samples=forwards.get_column("sample_id").to_numpy().astype(np.int64),
        sample_forwards=forwards.get_column("forward_index").to_numpy().astype(np.int64),
        rows_read=steps.done,
    )


def _among(column: pa.ChunkedArray, values: set[str]) -> pa.ChunkedArray:
    """Whether each entry of the string ``column`` (dictionary-encoded or plain) is one of
    ``values``; a dictionary column is matched through its dictionary."""
    wanted = pa.array(sorted(values), pa.string())
    pieces = []
    for chunk in column.chunks:
        if pa.types.is_dictionary(chunk.type):
            hits = pc.is_in(chunk.dictionary.cast(pa.string()), value_set=wanted)
            pieces.append(pc.fill_null(pc.take(hits, chunk.indices), False))
        else:
            pieces.append(pc.fill_null(pc.is_in(chunk.cast(pa.string()), value_set=wanted), False))
    return pa.chunked_array(pieces, pa.bool_())


def _sample_forwards(table: pa.Table) -> pl.DataFrame:
    """The ``(sample_id, forward_index)`` pairs of ``table``: one per run of equal sample ids
    (rows arrive grouped by sample; unordered rows give more pairs, deduplicated later)."""
    samples = table.column("sample_id").to_numpy()
    forwards = table.column("forward_index").to_numpy()
    starts = np.flatnonzero(np.concatenate(([True], samples[1:] != samples[:-1])))
    return pl.DataFrame(
        {"sample_id": samples[starts], "forward_index": forwards[starts]},
        schema={"sample_id": pl.Int64, "forward_index": pl.Int64},
    )


def _holds(tensors: pl.DataFrame, panel: Panel) -> bool:
    signal, metric = panel
    return not tensors.filter(
        (pl.col("signal") == signal) & (pl.col("metric") == metric)
    ).is_empty()


def _panel_grid(panel: Panel, folded: _Folded, width: int, order: Sequence[str]) -> PanelGrid:
    signal, metric = panel
    mine = (pl.col("signal") == signal) & (pl.col("metric") == metric)
    tensors = folded.tensors[0].filter(mine)
    tensors = ordered(tensors, layers=order).with_columns(
        (pl.col("recent_total") / pl.col("recent_count")).alias("recent_window_mean"),
        (pl.col("previous_total") / pl.col("previous_count")).alias("previous_window_mean"),
    )
    tensors = tensors.with_row_index("row").select(
        "row",
        *TENSOR_KEYS,
        "latest_sample",
        "latest",
        pl.when(pl.col("recent_count") > 0).then(pl.col("recent_window_mean")),
        pl.when(pl.col("previous_count") > 0).then(pl.col("previous_window_mean")),
    )
    cells = (
        folded.cells[0]
        .filter(mine)
        .join(tensors.select("row", *TENSOR_KEYS), on=list(TENSOR_KEYS), how="inner")
        .filter(pl.col("count") > 0)
    )
    shape = (tensors.height, width)
    mean, low, high = (np.full(shape, np.nan) for _ in range(3))
    at = (cells.get_column("row").to_numpy(), cells.get_column("column").to_numpy())
    mean[at] = (cells.get_column("total") / cells.get_column("count")).to_numpy()
    low[at] = cells.get_column("low").to_numpy()
    high[at] = cells.get_column("high").to_numpy()
    finite = np.isfinite(high)
    nonzero = bool(finite.any() and (np.abs(high[finite]).max() > 0 or low[finite].min() < 0))
    return PanelGrid(panel, tensors.drop("row"), mean, low, high, nonzero)
