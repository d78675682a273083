"""``compare_runs``' statistics of one partition of measurements, on a dense grid.

The runs are lined up by sample id: a measurement is compared over the shared samples at which
any run recorded it (its *grid*). In a partition (:mod:`ti_io.read.spill`) the measurements and
the shared samples index a matrix per run: ``value[measurement, sample]`` and whether the run
recorded it there. Every statistic is then a reduction along the sample axis (counts, the
latest grid sample, window means over the last grid samples, means before and after an onset),
without hashing rows. Measurements are taken a slice at a time so that the matrices stay under
:data:`CELLS` cells whatever the number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import polars as pl

CELLS: Final[int] = 1 << 23
"""Cells (measurements x shared samples) of one slice: about 140 MB for two runs."""


class DuplicateRowError(ValueError):
    """A run holds two rows for one measurement and sample (``key``, ``run``, ``sample_id``)."""

    def __init__(self, key: int, run: int, sample_id: int, rows: int) -> None:
        super().__init__(f"run {run} holds {rows} rows for measurement {key} at {sample_id}")
        self.key, self.run, self.sample_id, self.rows = key, run, sample_id, rows


@dataclass(frozen=True)
class Alignment:
    """What every partition is compared over."""

    shared: npt.NDArray[np.int64]
    """The sample ids every run holds, ascending."""
    runs: int
    window: int
    onset: int | None


@dataclass(frozen=True)
class _Rows:
    """A partition's rows as arrays; ``local`` the measurement's dense number."""

    local: npt.NDArray[np.int64]
    run: npt.NDArray[np.int64]
    sample: npt.NDArray[np.int64]
    value: npt.NDArray[np.float64]
    observed: npt.NDArray[np.bool_]

    def where(self, mask: npt.NDArray[np.bool_]) -> _Rows:
        return _Rows(
            self.local[mask],
            self.run[mask],
            self.sample[mask],
            self.value[mask],
            self.observed[mask],
        )


def aligned_statistics(
    frame: pl.DataFrame, alignment: Alignment, index: int, count: int
) -> pl.DataFrame:
    """The statistics of each (measurement, run) of partition ``index`` of ``count`` (its rows:
    ``key``, ``_run``, ``sample_id``, ``value``), one row per measurement of the partition and
    run: ``key``, ``_run``, ``in_run`` and the columns of :func:`ti_io.compare_runs` but the
    ratios. Raises :class:`DuplicateRowError` for a run with two rows at one sample."""
    keys = frame.get_column("key").to_numpy()
    # A partition holds the measurements whose id is ``index`` modulo ``count``: ``id //
    # count`` numbers them densely.
    local = keys.astype(np.int64) // count
    value = frame.get_column("value")
    rows = _Rows(
        local=local,
        run=frame.get_column("_run").to_numpy().astype(np.int64),
        sample=frame.get_column("sample_id").to_numpy(),
        value=value.fill_null(0.0).to_numpy(),
        observed=value.is_not_null().to_numpy(),
    )
    width = max(len(alignment.shared), 1)
    span = max(1, CELLS // width)
    height = int(local.max()) + 1 if len(local) else 0
    pieces = []
    for low in range(0, height, span):
        part = rows if height <= span else rows.where((local >= low) & (local < low + span))
        if len(part.local):
            pieces.append(_slice(part, alignment, low))
    table = pl.concat(pieces) if pieces else _empty()
    key = (pl.col("_local") * count + index).cast(pl.UInt32).alias("key")
    return table.with_columns(key).drop("_local")


def _positions(
    sample: npt.NDArray[np.int64], shared: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Each sample's position among ``shared`` and whether it is one of them."""
    width = len(shared)
    if width and int(shared[-1]) - int(shared[0]) + 1 == width:  # consecutive ids: no search
        at = sample - shared[0]
        return at, (at >= 0) & (at < width)
    at = np.searchsorted(shared, sample)
    aligned = at < width
    aligned[aligned] = shared[at[aligned]] == sample[aligned]
    return at, aligned


def _slice(rows: _Rows, alignment: Alignment, first: int) -> pl.DataFrame:
    """The statistics of the measurements ``first``, ``first + 1``, ... that ``rows`` hold."""
    shared = alignment.shared
    width = len(shared)
    local = rows.local - first
    height = int(local.max()) + 1
    runs = alignment.runs
    cells = height * width
    present = np.zeros((runs, height), dtype=bool)
    present[rows.run, local] = True
    at, aligned = _positions(rows.sample, shared)
    flat = (rows.run * cells + local * width + at)[aligned]
    counts = np.bincount(flat, minlength=runs * cells)
    if counts.size and counts.max() > 1:
        bad = int(np.argmax(counts > 1))
        run, cell = divmod(bad, cells)
        raise DuplicateRowError(
            first + cell // width, run, int(shared[cell % width]), int(counts[bad])
        )
    recorded = (counts > 0).reshape(runs, height, width)
    seen_rows = rows.observed[aligned]
    observed_flat = np.zeros(runs * cells, dtype=bool)
    observed_flat[flat[seen_rows]] = True
    observed = observed_flat.reshape(runs, height, width)
    values_flat = np.zeros(runs * cells, dtype=np.float64)
    values_flat[flat[seen_rows]] = rows.value[aligned][seen_rows]
    values = values_flat.reshape(runs, height, width)
    grid: npt.NDArray[np.bool_] = np.logical_or.reduce(recorded, axis=0)
    samples = grid.sum(axis=1)
    back = np.cumsum(grid[:, ::-1], axis=1)[:, ::-1]
    last = np.where(samples > 0, width - 1 - np.argmax(grid[:, ::-1], axis=1), -1)
    has_last = last >= 0
    latest_sample = np.where(has_last, shared[np.maximum(last, 0)] if width else 0, 0)
    window = alignment.window
    recent = grid & (back <= window)
    previous = grid & (back > window) & (back <= 2 * window)
    after: npt.NDArray[np.bool_] | None = None
    if alignment.onset is not None:
        after = shared >= alignment.onset
    keys = np.flatnonzero(present.any(axis=0))
    rows_at = np.arange(height)
    at_last = np.maximum(last, 0)
    columns: dict[str, list[npt.NDArray[np.generic]]] = {}
    means: list[str] = []

    def add(name: str, column: npt.NDArray[np.generic]) -> None:
        columns.setdefault(name, []).append(column[keys])

    def add_mean(name: str, picked: npt.NDArray[np.float64], mask: npt.NDArray[np.bool_]) -> None:
        counts = mask.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            add(name, np.where(mask, picked, 0.0).sum(axis=1) / counts)
        add(f"_{name}_n", counts)
        if name not in means:
            means.append(name)

    for r in range(runs):
        seen = observed[r]
        picked = values[r]
        latest_seen = has_last & seen[rows_at, at_last]
        add("_local", rows_at + first)
        add("_run", np.full(height, r, dtype=np.int32))
        add("in_run", present[r])
        add("samples", samples.astype(np.int64))
        add("measured", seen.sum(axis=1).astype(np.int64))
        add("latest_sample", latest_sample.astype(np.int64))
        add("_has_latest", has_last)
        add("latest", np.where(latest_seen, picked[rows_at, at_last], 0.0))
        add("_latest_seen", latest_seen)
        add_mean("recent_window_mean", picked, seen & recent)
        add_mean("previous_window_mean", picked, seen & previous)
        if after is not None:
            add_mean("before_mean", picked, seen & ~after)
            add_mean("after_mean", picked, seen & after)
            add("samples_after", (grid & after).sum(axis=1).astype(np.int64))
            add("measured_after", (seen & after).sum(axis=1).astype(np.int64))
    frame = pl.DataFrame({name: np.concatenate(parts) for name, parts in columns.items()})
    nulls = [
        pl.when(pl.col("_has_latest")).then(pl.col("latest_sample")).alias("latest_sample"),
        pl.when(pl.col("_latest_seen")).then(pl.col("latest")).alias("latest"),
        *(pl.when(pl.col(f"_{name}_n") > 0).then(pl.col(name)).alias(name) for name in means),
    ]
    hidden = ["_has_latest", "_latest_seen", *(f"_{name}_n" for name in means)]
    return frame.with_columns(nulls).drop(hidden)


def _empty() -> pl.DataFrame:
    return pl.DataFrame(schema={"_local": pl.Int64, "_run": pl.Int32, "in_run": pl.Boolean})


__all__ = ["CELLS", "Alignment", "DuplicateRowError", "aligned_statistics"]
