"""A run's measurements reduced to what a page can draw, in memory bounded by the page.

One pass over the history, a row group at a time (:mod:`ti_io.read.row_groups`), folds every
row of the chosen panels (a signal and a metric each) into cells: one per tensor and *column*,
a column being a run of consecutive samples (at most ``columns`` of them, equal numbers of
samples each). A cell keeps the minimum, maximum, sum and count of its finite values (the
min/max envelope and the mean of the samples it covers), so the page's size and the reader's
memory grow with tensors x columns, never with the run's length. The same pass keeps each
tensor's latest value (NaN and infinity as they are) and its last ``2 * window``
observations, from which its window means are taken with result.json's own expressions
(:mod:`ti_io.read.aggregates`), and the forward index of each sample (where the events go on
the time axis).
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
from ti_io.read.aggregates import TAIL, tail_expr, window_exprs
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
    """The first sample id of each column."""
    end_sample: int
    """One past the last sample id (the last column's right edge)."""
    samples: npt.NDArray[np.int64]
    """Every sample id of the run, ascending."""
    sample_forwards: npt.NDArray[np.int64]
    """The root forward index of each of ``samples``."""

    @property
    def column_edges(self) -> npt.NDArray[np.int64]:
        """The columns' edges on the sample axis (one more than the columns): column ``c``
        covers samples ``edges[c]`` to ``edges[c + 1] - 1``."""
        return np.append(self.column_samples, self.end_sample).astype(np.int64)

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
)
_PLAIN: Final[pl.Expr] = pl.col(pl.Categorical).cast(pl.String)
"""Rows are grouped by their dictionary codes; the few aggregated rows get plain strings."""
_KEYS: Final[list[str]] = ["signal", "metric", *(k for k in TENSOR_KEYS if k != "signal")]


class _Folded:
    """Partial aggregates of the row groups read so far, merged every few groups."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.cells: list[pl.DataFrame] = []
        self.tensors: list[pl.DataFrame] = []
        self.tails: list[pl.DataFrame] = []
        """Each tensor's last ``2 * window`` observations (non-null values, NaN included):
        what result.json's window means are taken from."""
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
        self.tensors.append(
            rows.group_by(*_KEYS)
            .agg(
                pl.col("value").sort_by("sample_id").last().alias("latest"),
                pl.col("sample_id").max().alias("latest_sample"),
            )
            .with_columns(_PLAIN)
        )
        self.tails.append(self._tail(rows.filter(pl.col("value").is_not_null())))
        if len(self.cells) >= _COMPACT_EVERY:
            self.compact()

    def _tail(self, rows: pl.DataFrame) -> pl.DataFrame:
        return (
            rows.select(*_KEYS, "sample_id", "value")
            .sort("sample_id")
            .group_by(*_KEYS, maintain_order=True)
            .tail(2 * self.window)
            .with_columns(_PLAIN)
        )

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
        if self.tails:
            self.tails = [self._tail(pl.concat(self.tails))]


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
    chosen = set(layers)
    folded = _Folded(window)
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
        ids = rows.get_column("sample_id").to_numpy()
        at = np.searchsorted(ordered_samples, ids)
        # A live run's part published after ``samples`` was read holds later samples: left
        # out, as if read a moment earlier.
        known = (at < ordered_samples.size) & (
            ordered_samples[np.minimum(at, ordered_samples.size - 1)] == ids
        )
        if not known.all():
            rows, at = rows.filter(pl.Series(known)), at[known]
            if rows.is_empty():
                return
        folded.add(rows.with_columns(pl.Series("column", column_of[at])))

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
        end_sample=int(ordered_samples[-1]) + 1 if ordered_samples.size else 0,
        samples=forwards.get_column("sample_id").to_numpy().astype(np.int64),
        sample_forwards=forwards.get_column("forward_index").to_numpy().astype(np.int64),
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
    windows = (
        folded.tails[0]
        .filter(mine)
        .sort("sample_id")
        .group_by(*_KEYS)
        .agg(tail_expr(folded.window))
        .with_columns(window_exprs(folded.window))
        .drop(TAIL)
    )
    tensors = folded.tensors[0].filter(mine).join(windows, on=_KEYS, how="left", nulls_equal=True)
    tensors = (
        ordered(tensors, layers=order)
        .with_row_index("row")
        .select(
            "row",
            *TENSOR_KEYS,
            "latest_sample",
            "latest",
            "recent_window_mean",
            "previous_window_mean",
        )
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
    return PanelGrid(tensors.drop("row"), mean, low, high, nonzero)
