"""Line up the same measurement across ranks and show where ranks differ.

The table has one row per measured tensor, metric and sample (``layer``, ``call_index``,
``signal``, ``tensor_path``, ``metric`` and ``sample_id`` or ``forward_index``), with every
rank's value side by side, the spread across ranks, and the ranks that stand out. It describes;
it does not judge: "stands out" is a fixed, documented rule, not a diagnosis.

Rule for ``standout_ranks``, applied within each row:

- a rank whose value is unavailable (null) while another rank has one (``unavailable_ranks``);
- a rank whose value is NaN or infinite (``nonfinite_ranks``);
- a rank whose finite value is far from the median of the finite values across ranks
  (``outlier_ranks``): ``|value - median| > threshold * 1.4826 * MAD``, where MAD is the median
  absolute deviation (1.4826 * MAD estimates the standard deviation for normal data). When the
  MAD is 0 (at least half the ranks agree exactly), any rank differing from the median by more
  than ``atol + rtol * |median|`` stands out. With two ranks the MAD rule cannot name one of
  them (both sit equally far from the median), so only the first two rules apply in practice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

import polars as pl

from ti_dist.partitions import RankPartitions, plain
from ti_io.read.filters import names, signal_names
from ti_io.read.frames import PathOrFrame
from ti_schema import Signal

MAD_TO_STD: Final[float] = 1.4826
"""Scales the median absolute deviation to a standard deviation for normally distributed data."""

TENSOR_KEY: Final[tuple[str, ...]] = ("layer", "call_index", "signal", "tensor_path", "metric")
AlignOn = Literal["sample_id", "forward_index"]
"""The column that lines rows up across ranks (see :func:`compare_ranks`)."""


def _validate(threshold: float, rtol: float, atol: float, align_on: AlignOn) -> None:
    if align_on not in ("sample_id", "forward_index"):
        raise ValueError(f"align_on must be 'sample_id' or 'forward_index', got {align_on!r}")
    for name, value in (("threshold", threshold), ("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def _refuse_several_runs(table: pl.DataFrame, rows: pl.LazyFrame, key: list[str]) -> None:
    """Raise when some rank has more than one row for one measurement (several runs mixed)."""
    mixed = table.filter(pl.col("_distinct_ranks") < pl.col("n_ranks"))
    if not mixed.height:
        return
    first = mixed.row(0, named=True)
    where = pl.lit(True)
    for name in key:
        where = where & (pl.col(name) == first[name])
    counts = (
        rows.filter(where)
        .group_by("rank")
        .agg(pl.len().alias("n"), pl.col("run_id").unique().sort().alias("run_ids"))
        .filter(pl.col("n") > 1)
        .sort("rank")
        .collect()
        .row(0, named=True)
    )
    raise ValueError(
        f"rank {counts['rank']} has {counts['n']} rows for one measurement (layer="
        f"{first['layer']!r}, metric={first['metric']!r}, {key[-1]}={first[key[-1]]}), from "
        f"run_ids {counts['run_ids']}: the data holds more than one run per rank; filter by "
        "run_id before comparing"
    )


def compare_ranks(
    source: PathOrFrame,
    *,
    layer: str | Sequence[str] | None = None,
    signal: Signal | Sequence[Signal] | None = None,
    metric: str | Sequence[str] | None = None,
    align_on: AlignOn = "sample_id",
    threshold: float = 5.0,
    rtol: float = 1e-9,
    atol: float = 0.0,
    only_standouts: bool = False,
) -> pl.DataFrame:
    """A table comparing each measurement across ranks.

    ``source`` is a run's ``output_dir`` (every rank's rows, read a range of steps at a time:
    :class:`~ti_dist.partitions.RankPartitions`) or a frame of ``ti.history`` rows.
    ``layer``, ``signal`` and ``metric`` filter (one name or several). Rows line up by
    ``layer``, ``call_index``, ``signal``, ``tensor_path``, ``metric`` and ``align_on``:
    ``sample_id`` matches when every rank samples the same forwards (lockstep
    training with ``EveryNForwardsSampler`` or ``AlwaysSampler``); use ``forward_index`` when
    ranks sampled on their own clocks (``TimedSampler``) and compare only forwards both sampled.

    Columns: the key columns; ``ranks`` and ``values`` (aligned lists, ordered by rank);
    ``n_ranks``; ``min``, ``max``, ``spread`` (max - min), ``median`` over the finite values;
    ``min_rank`` and ``max_rank`` (lowest rank holding the min / max); ``unavailable_ranks``,
    ``nonfinite_ranks``, ``outlier_ranks`` and their union ``standout_ranks`` (rule in this
    module's docstring, scaled by ``threshold``, ``rtol`` and ``atol``).
    ``only_standouts=True`` keeps only rows where some rank stands out.
    One row per rank and key is required: a frame holding several runs of the same rank is an
    error (filter it by ``run_id`` first).
    """
    _validate(threshold, rtol, atol, align_on)
    layers, metrics = names(layer, "layer"), names(metric, "metric")
    signals = signal_names(signal)

    def keep(measurement: dict[str, Any]) -> bool:
        return (
            (layers is None or measurement["layer"] in layers)
            and (signals is None or measurement["signal"] in signals)
            and (metrics is None or measurement["metric"] in metrics)
        )

    key = [*TENSOR_KEY, align_on]
    with RankPartitions(source, align=align_on, keep=keep) as parts:
        pieces = [
            _compared(frame.lazy(), key, threshold, rtol, atol, only_standouts)
            for frame in parts.frames()
        ]
    return pl.concat(pieces).sort(key) if len(pieces) > 1 else pieces[0]


def _compared(
    frame: pl.LazyFrame,
    key: list[str],
    threshold: float,
    rtol: float,
    atol: float,
    only_standouts: bool,
) -> pl.DataFrame:
    """:func:`compare_ranks`' rows of the steps ``frame`` holds (every rank's rows of them)."""
    rows = frame.select(
        [*key, pl.col("rank").cast(pl.Int32), "run_id", pl.col("value").cast(pl.Float64)]
    )
    finite = pl.col("value").is_not_null() & pl.col("value").is_finite()
    rows = rows.with_columns(pl.col("value").filter(finite).median().over(key).alias("median"))
    deviation = (pl.col("value") - pl.col("median")).abs()
    rows = rows.with_columns(deviation.filter(finite).median().over(key).alias("_mad"))
    tolerance = atol + rtol * pl.col("median").abs()
    outlier = finite & (
        pl.when(pl.col("_mad") > 0)
        .then(deviation > threshold * MAD_TO_STD * pl.col("_mad"))
        .otherwise(deviation > tolerance)
    )
    rows = rows.with_columns(
        outlier.fill_null(False).alias("_outlier"),
        (pl.col("value").is_not_null() & ~pl.col("value").is_finite()).alias("_nonfinite"),
        pl.col("value").is_null().alias("_null"),
    )

    def ranks_where(condition: pl.Expr) -> pl.Expr:
        return pl.col("rank").filter(condition).sort()

    table = (
        rows.group_by(key)
        .agg(
            pl.col("rank").sort().alias("ranks"),
            pl.col("value").sort_by("rank").alias("values"),
            pl.len().cast(pl.Int64).alias("n_ranks"),
            pl.col("rank").n_unique().cast(pl.Int64).alias("_distinct_ranks"),
            pl.col("value").filter(finite).min().alias("min"),
            pl.col("value").filter(finite).max().alias("max"),
            pl.col("median").first().alias("median"),
            pl.col("rank")
            .filter(finite & (pl.col("value") == pl.col("value").filter(finite).min()))
            .min()
            .alias("min_rank"),
            pl.col("rank")
            .filter(finite & (pl.col("value") == pl.col("value").filter(finite).max()))
            .min()
            .alias("max_rank"),
            ranks_where(pl.col("_null")).alias("unavailable_ranks"),
            pl.col("_null").all().alias("_all_null"),
            ranks_where(pl.col("_nonfinite")).alias("nonfinite_ranks"),
            ranks_where(pl.col("_outlier")).alias("outlier_ranks"),
        )
        .collect()
    )
    _refuse_several_runs(table, rows, key)

    # Unavailable on every rank is not a rank standing out; it is the measurement's nature.
    table = table.with_columns(
        (pl.col("max") - pl.col("min")).alias("spread"),
        pl.when(pl.col("_all_null"))
        .then(pl.col("unavailable_ranks").list.slice(0, 0))
        .otherwise(pl.col("unavailable_ranks"))
        .alias("_unavailable_standout"),
    )
    table = table.with_columns(
        pl.concat_list(["_unavailable_standout", "nonfinite_ranks", "outlier_ranks"])
        .list.unique()
        .list.sort()
        .alias("standout_ranks")
    )
    if only_standouts:
        table = table.filter(pl.col("standout_ranks").list.len() > 0)
    columns = table.select(
        *key,
        "n_ranks",
        "min",
        "max",
        "spread",
        "median",
        "min_rank",
        "max_rank",
        "standout_ranks",
        "unavailable_ranks",
        "nonfinite_ranks",
        "outlier_ranks",
        "ranks",
        "values",
    )
    return plain(columns).sort(key)
