"""result.json's statistics computed from rows: per measurement, over its samples.

Aggregates describe the per-sample values of one metric of one tensor, ordered by
``sample_id`` (each sample weighs the same; these are not pooled tensor distributions).
Unavailable samples (null ``value``) are counted and left out of every aggregate. The window
means use the last ``min(observations, window)`` observations (``recent_window_mean``) and the
up to ``window`` observations before them (``previous_window_mean``): short histories get
partial windows, and a window mean is null only when its window is empty. Finalization
(:mod:`ti_io.finish.digest`) and ``ti summary`` compute them with these expressions, one
partition of measurements at a time (:mod:`ti_io.read.measurements`).
"""

from __future__ import annotations

from typing import Final

import polars as pl

from ti_schema.result_json import AGGREGATE_KEYS

AGGREGATES: Final[tuple[str, ...]] = AGGREGATE_KEYS
"""Numeric aggregates of a statistic, in the order they are written (owned by ti-schema)."""


def value_exprs() -> list[pl.Expr]:
    """The aggregates of ``value`` within one group that do not depend on row order: counts,
    mean, population std, min, exact quartiles (linear interpolation), max."""
    value = pl.col("value")
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
    ]


TAIL: Final[str] = "_tail"
"""The column :func:`tail_expr` makes and :func:`window_exprs` reads."""


def tail_expr(window: int) -> pl.Expr:
    """Within one group whose rows are in sample order: its last ``2 * window`` observations
    (a list, oldest first), from which :func:`window_exprs` takes the window means."""
    return pl.col("value").drop_nulls().tail(2 * window).alias(TAIL)


def window_exprs(window: int) -> list[pl.Expr]:
    """``previous_window_mean`` and ``recent_window_mean`` from the :func:`tail_expr` column:
    the recent window is its last ``min(observations, window)`` values, the previous one the up
    to ``window`` before them (null when empty)."""
    tail = pl.col(TAIL)
    earlier = (tail.list.len().cast(pl.Int64) - window).clip(lower_bound=0)
    return [
        tail.list.slice(0, earlier).list.mean().alias("previous_window_mean"),
        tail.list.tail(window).list.mean().alias("recent_window_mean"),
    ]
