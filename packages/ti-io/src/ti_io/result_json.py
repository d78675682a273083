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
import math
import re
from collections.abc import Iterable, Mapping, Sequence
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


def statistic_exprs(window: int) -> list[pl.Expr]:
    """Aggregates of ``value`` within one group. Independent of row order: the windows are
    chosen by ``sample_id`` (sample ids are unique within a group), quantiles are exact with
    linear interpolation. Short histories get null windows in :func:`statistic`."""
    value = pl.col("value")
    available = value.is_not_null()
    observed = value.filter(available)
    observed_ids = pl.col("sample_id").filter(available)
    # First sample id of each window, found by selection (top_k), not by sorting the group.
    recent_start = observed_ids.top_k(window).min()
    previous_start = observed_ids.top_k(2 * window).min()
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
        observed.filter((observed_ids >= previous_start) & (observed_ids < recent_start))
        .mean()
        .alias("previous_window_mean"),
        observed.filter(observed_ids >= recent_start).mean().alias("recent_window_mean"),
    ]


def aggregate(history: pl.LazyFrame, window: int) -> pl.LazyFrame:
    """One row per (tensor, metric) with every aggregate of result.json (lazy), straight from
    a history frame; used by readers such as ``ti summary`` on live parts."""
    latest = pl.col("sample_id").arg_max()
    return history.group_by(list(GROUP_KEYS)).agg(
        *statistic_exprs(window),
        pl.col("shape").get(latest).alias("latest_shape"),
        pl.col("dtype").get(latest).alias("dtype"),
        pl.col("module_type").first().alias("module_type"),
        pl.col("unavailable_reason").drop_nulls().first().alias("first_reason"),
        pl.col("unavailable_reason").drop_nulls().n_unique().alias("reasons"),
    )


def _number(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def statistic(row: Mapping[str, Any], window: int) -> dict[str, Any]:
    """The statistics entry of one aggregated row (nulls explained, strict JSON)."""
    observations = int(row["observations"])
    unavailable = int(row["unavailable"])
    stats: dict[str, Any] = {"observations": observations, "unavailable": unavailable}
    reasons: list[str] = []
    if observations == 0:
        stats.update(dict.fromkeys(AGGREGATES))
        reason = f"all {unavailable} samples unavailable: {row['first_reason']}"
        others = int(row["reasons"]) - 1
        if others > 0:
            reason += (
                f" (and {others} other reason{'s' if others > 1 else ''}; see "
                "unavailable_reason in history.parquet)"
            )
        reasons.append(reason)
    else:
        for key in AGGREGATES:
            stats[key] = _number(row[key])
        window_nulls: tuple[str, ...] = ()
        if observations < window:
            window_nulls = ("previous_window_mean", "recent_window_mean")
            reasons.append(
                f"window means need {window} (recent) and {2 * window} (previous) observations; "
                f"{observations} available"
            )
        elif observations < 2 * window:
            window_nulls = ("previous_window_mean",)
            reasons.append(
                f"previous_window_mean needs {2 * window} observations ({window} per window); "
                f"{observations} available"
            )
        for key in window_nulls:
            stats[key] = None
        nonfinite = [
            k
            for k in AGGREGATES
            if k not in window_nulls and row[k] is not None and stats[k] is None
        ]
        if nonfinite:
            reasons.append(
                f"{', '.join(nonfinite)} not finite: the observations include NaN or infinity"
            )
    stats["unavailable_reason"] = "; ".join(reasons) if reasons else None
    return stats


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
    tensors: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in aggregated.iter_rows(named=True):
        layer = row["layer"]
        record = records.get(layer)
        if record is None:
            record = records[layer] = {
                "layer": layer,
                "type": row["module_type"],
                "aliases": [],
                "tensors": [],
            }
        key = tuple(row[k] for k in TENSOR_KEYS)
        tensor = tensors.get(key)
        if tensor is None:
            tensor = tensors[key] = {
                "call_index": int(row["call_index"]),
                "signal": row["signal"],
                "tensor_path": row["tensor_path"],
                "mode": row["mode"],
                "grad_enabled": bool(row["grad_enabled"]),
                "latest_shape": [int(s) for s in row["latest_shape"] or []],
                "dtype": row["dtype"],
                "statistics": {},
            }
            record["tensors"].append(tensor)
        tensor["statistics"][row["metric"]] = statistic(row, window)
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


_INT_LIST: Final[re.Pattern[str]] = re.compile(r"\[\n\s+(-?\d+(?:,\n\s+-?\d+)*)\n\s*\]")


def dumps(records: list[dict[str, Any]]) -> str:
    """Strict JSON text of result.json (raises ValueError on NaN/Infinity); integer lists
    (shapes) on one line. Safe as a text edit: JSON strings never hold a raw newline."""
    text = json.dumps(records, indent=2, ensure_ascii=False, allow_nan=False)
    return _INT_LIST.sub(lambda m: "[" + re.sub(r",\n\s+", ", ", m.group(1)) + "]", text) + "\n"


def write_result_json(path: Path, records: list[dict[str, Any]]) -> None:
    """Publish result.json atomically."""
    publish_text(path, dumps(records))
