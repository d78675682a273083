"""result.json's statistics computed from rows: per measurement, over its samples.

Aggregates describe the per-sample values of one metric of one tensor, ordered by
``sample_id`` (each sample weighs the same; these are not pooled tensor distributions).
Unavailable samples (null ``value``) are counted and left out of every aggregate. The window
means use the last ``min(observations, window)`` observations (``recent_window_mean``) and the
up to ``window`` observations before them (``previous_window_mean``): short histories get
partial windows, and a window mean is null only when its window is empty. Finalization
(:mod:`ti_io.finish.digest`) and ``ti summary`` on live parts compute them alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import polars as pl

from ti_io.read.ordering import GROUP_KEYS
from ti_schema.result_json import AGGREGATE_KEYS

AGGREGATES: Final[tuple[str, ...]] = AGGREGATE_KEYS
"""Numeric aggregates of a statistic, in the order they are written (owned by ti-schema)."""


def window_ranks(keys: Sequence[str]) -> pl.Expr:
    """Per row: 1 for the newest observation of its group (by ``sample_id``), 2 for the one
    before... null for unavailable rows. Feeds :func:`statistic_exprs`; a window function
    instead of per-group filters keeps every aggregation on Polars' fast path."""
    observed_ids = pl.when(pl.col("value").is_not_null()).then(pl.col("sample_id"))
    return observed_ids.rank("ordinal", descending=True).over(list(keys)).alias("_rank")


def statistic_exprs(window: int) -> list[pl.Expr]:
    """Aggregates of ``value`` within one group, over a frame that has the ``_rank`` column of
    :func:`window_ranks`. Independent of row order: the windows are chosen by ``sample_id``
    (unique within a group), quantiles are exact with linear interpolation. A short history
    fills its windows partially (an empty window's mean is null)."""
    value = pl.col("value")
    rank = pl.col("_rank")
    return [
        value.count().alias("observations"),
        value.null_count().alias("unavailable"),
        value.mean().alias("mean"),
        value.std(ddof=0).alias("std"),
        value.min().alias("min"),
        value.quantile(0.25, interpolation="linear").alias("p25"),
        value.quantile(0.5, interpolation="linear").alias("p50"),
        value.quantile(0.75, interpolation="linear").alias("p75"),
        value.max().alias("max"),
        pl.when((rank > window) & (rank <= 2 * window))
        .then(value)
        .mean()
        .alias("previous_window_mean"),
        pl.when(rank <= window).then(value).mean().alias("recent_window_mean"),
    ]


def aggregate(history: pl.LazyFrame, window: int) -> pl.LazyFrame:
    """One row per (tensor, metric) with every aggregate of result.json (lazy), straight from
    a history frame; used by readers such as ``ti summary`` on live parts."""
    latest = pl.col("sample_id").arg_max()
    ranked = history.with_columns(window_ranks(GROUP_KEYS))
    return ranked.group_by(list(GROUP_KEYS)).agg(
        *statistic_exprs(window),
        pl.col("shape").get(latest).alias("latest_shape"),
        pl.col("dtype").get(latest).alias("dtype"),
        pl.col("module_type").first().alias("module_type"),
        pl.col("unavailable_reason").drop_nulls().first().alias("first_reason"),
        pl.col("unavailable_reason").drop_nulls().n_unique().alias("reasons"),
    )
