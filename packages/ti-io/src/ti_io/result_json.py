"""result.json: the history aggregated per layer, call, signal, tensor path and context.

Aggregates describe the per-sample values of one metric of one tensor, ordered by
``sample_id`` (each sample weighs the same; these are not pooled tensor distributions).
Unavailable samples (null ``value``) are counted and left out of every aggregate. The window
means use the last ``window`` observations (``recent_window_mean``) and the ``window``
observations before them (``previous_window_mean``). A null aggregate always comes with
``unavailable_reason``; NaN and infinity are never written (strict JSON).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import polars as pl

from ti_io.facts import LayerLike
from ti_io.layout import publish_text
from ti_schema import SIGNALS

TENSOR_KEYS: Final[tuple[str, ...]] = (
    "layer",
    "call_index",
    "signal",
    "tensor_path",
    "mode",
    "grad_enabled",
)
GROUP_KEYS: Final[tuple[str, ...]] = (*TENSOR_KEYS, "metric")
AGGREGATES: Final[tuple[str, ...]] = (
    "mean",
    "std",
    "min",
    "p25",
    "p50",
    "p75",
    "max",
    "previous_window_mean",
    "recent_window_mean",
)
"""Numeric aggregates of a statistic, in the order they are written."""


def window_ranks(keys: Sequence[str]) -> pl.Expr:
    """Per row: 1 for the newest observation of its group (by ``sample_id``), 2 for the one
    before... null for unavailable rows. Feeds :func:`statistic_exprs`; a window function
    instead of per-group filters keeps every aggregation on Polars' fast path."""
    observed_ids = pl.when(pl.col("value").is_not_null()).then(pl.col("sample_id"))
    return observed_ids.rank("ordinal", descending=True).over(list(keys)).alias("_rank")


def statistic_exprs(window: int) -> list[pl.Expr]:
    """Aggregates of ``value`` within one group, over a frame that has the ``_rank`` column of
    :func:`window_ranks`. Independent of row order: the windows are chosen by ``sample_id``
    (unique within a group), quantiles are exact with linear interpolation. Short histories
    get null windows in :func:`finish_statistics`."""
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


STATISTIC_KEYS: Final[tuple[str, ...]] = (
    "observations",
    "unavailable",
    *AGGREGATES,
    "unavailable_reason",
)
"""Keys of one statistics entry, in the order they are written."""


def finish_statistics(aggregated: pl.DataFrame, window: int) -> pl.DataFrame:
    """Apply result.json's null rules to raw aggregates, vectorized: non-finite aggregates and
    window means of too short histories become null, and ``unavailable_reason`` says why."""
    observations = pl.col("observations")
    short = {
        "recent_window_mean": observations < window,
        "previous_window_mean": observations < 2 * window,
    }
    nulled = {
        key: pl.when(short[key]).then(None).otherwise(pl.col(key)) if key in short else pl.col(key)
        for key in AGGREGATES
    }
    nonfinite = pl.concat_str(
        [
            pl.when(expr.is_not_null() & ~expr.is_finite()).then(pl.lit(key))
            for key, expr in nulled.items()
        ],
        separator=", ",
        ignore_nulls=True,
    )
    window_reason = (
        pl.when(observations < window)
        .then(
            pl.format(
                "window means need {} (recent) and {} (previous) observations; {} available",
                pl.lit(window),
                pl.lit(2 * window),
                observations,
            )
        )
        .when(observations < 2 * window)
        .then(
            pl.format(
                "previous_window_mean needs {} observations ({} per window); {} available",
                pl.lit(2 * window),
                pl.lit(window),
                observations,
            )
        )
    )
    others = pl.col("reasons") - 1
    all_unavailable = pl.concat_str(
        [
            pl.format(
                "all {} samples unavailable: {}", pl.col("unavailable"), pl.col("first_reason")
            ),
            pl.when(others == 1).then(
                pl.lit(" (and 1 other reason; see unavailable_reason in history.parquet)")
            ),
            pl.when(others > 1).then(
                pl.format(
                    " (and {} other reasons; see unavailable_reason in history.parquet)", others
                )
            ),
        ],
        ignore_nulls=True,
    )
    reason = (
        pl.when(observations == 0)
        .then(all_unavailable)
        .otherwise(
            pl.concat_str(
                [
                    window_reason,
                    pl.when(nonfinite != "").then(
                        pl.format(
                            "{} not finite: the observations include NaN or infinity", nonfinite
                        )
                    ),
                ],
                separator="; ",
                ignore_nulls=True,
            )
        )
    )
    return aggregated.with_columns(
        *(
            pl.when(observations > 0)
            .then(pl.when(expr.is_finite()).then(expr))
            .cast(pl.Float64)
            .alias(key)
            for key, expr in nulled.items()
        ),
        pl.when(reason != "").then(reason).alias("unavailable_reason"),
    )


def _signal_order(signal: str) -> int:
    return SIGNALS.index(signal) if signal in SIGNALS else len(SIGNALS)


def _metric_order(metrics: Sequence[str]) -> dict[str, int]:
    return {name: i for i, name in enumerate(metrics)}


def build_records(
    catalog: Iterable[LayerLike],
    aggregated: pl.DataFrame | None,
    *,
    window: int,
    metrics: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Layer records: every catalog layer in catalog order (executed or not), then any layer
    that only the history names, each with its tensors and per-metric statistics."""
    records: dict[str, dict[str, Any]] = {}
    for info in catalog:
        if info.name not in records:
            records[info.name] = {
                "layer": info.name,
                "type": info.module_type,
                "aliases": list(info.aliases),
                "tensors": [],
            }
    if aggregated is None or aggregated.height == 0:
        return list(records.values())
    order = _metric_order(metrics)
    finished = finish_statistics(aggregated, window)
    tensors: dict[tuple[Any, ...], dict[str, Any]] = {}
    columns = [*TENSOR_KEYS, "metric", "module_type", "latest_shape", "dtype"]
    for row, stats in zip(
        finished.select(columns).iter_rows(),
        finished.select(STATISTIC_KEYS).iter_rows(),
        strict=True,
    ):
        layer, call_index, signal, tensor_path, mode, grad_enabled, metric = row[:7]
        module_type, latest_shape, dtype = row[7:]
        record = records.get(layer)
        if record is None:
            record = records[layer] = {
                "layer": layer,
                "type": module_type,
                "aliases": [],
                "tensors": [],
            }
        key = row[:6]
        tensor = tensors.get(key)
        if tensor is None:
            tensor = tensors[key] = {
                "call_index": int(call_index),
                "signal": signal,
                "tensor_path": tensor_path,
                "mode": mode,
                "grad_enabled": bool(grad_enabled),
                "latest_shape": [int(s) for s in latest_shape or []],
                "dtype": dtype,
                "statistics": {},
            }
            record["tensors"].append(tensor)
        tensor["statistics"][metric] = dict(zip(STATISTIC_KEYS, stats, strict=True))
    for record in records.values():
        record["tensors"].sort(
            key=lambda t: (
                t["call_index"],
                _signal_order(t["signal"]),
                t["tensor_path"],
                t["mode"],
                t["grad_enabled"],
            )
        )
        for tensor in record["tensors"]:
            stats = tensor["statistics"]
            tensor["statistics"] = {
                m: stats[m] for m in sorted(stats, key=lambda m: (order.get(m, len(order)), m))
            }
    return list(records.values())


def dumps(records: list[dict[str, Any]]) -> str:
    """Strict JSON text of result.json (raises ValueError on NaN/Infinity): one layer record
    per line, which keeps Python's C encoder (an ``indent`` would select the slow one) and
    reads well with ``jq`` or line-oriented tools."""
    encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode
    if not records:
        return "[]\n"
    return "[\n" + ",\n".join(encode(r) for r in records) + "\n]\n"


def write_result_json(path: Path, records: list[dict[str, Any]]) -> None:
    """Publish result.json atomically."""
    publish_text(path, dumps(records))
