"""result.json: the history aggregated per layer, call, signal, tensor path and context.

Aggregates describe the per-sample values of one metric of one tensor, ordered by
``sample_id`` (each sample weighs the same; these are not pooled tensor distributions).
Unavailable samples (null ``value``) are counted and left out of every aggregate. The window
means use the last ``min(observations, window)`` observations (``recent_window_mean``) and the
up to ``window`` observations before them (``previous_window_mean``): short histories get
partial windows, and a window mean is null only when its window is empty. A null aggregate
always comes with ``unavailable_reason``; NaN and infinity are never written (strict JSON).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import polars as pl

from ti_io.facts import LayerLike
from ti_io.publishing import publish_text
from ti_schema import SIGNALS
from ti_schema.result_json import AGGREGATE_KEYS

TENSOR_KEYS: Final[tuple[str, ...]] = (
    "layer",
    "call_index",
    "signal",
    "tensor_path",
    "mode",
    "grad_enabled",
)
GROUP_KEYS: Final[tuple[str, ...]] = (*TENSOR_KEYS, "metric")
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


STATISTIC_KEYS: Final[tuple[str, ...]] = (
    "observations",
    "unavailable",
    *AGGREGATES,
    "unavailable_reason",
)
"""Keys of one statistics entry, in the order they are written."""


def finish_statistics(aggregated: pl.DataFrame, window: int) -> pl.DataFrame:
    """Apply result.json's null rules to raw aggregates, vectorized: non-finite aggregates and
    the mean of an empty window become null, and ``unavailable_reason`` says why.

    The recent window holds the last ``min(observations, window)`` observations, so it is empty
    only when there is no observation (every aggregate is null then); the previous window holds
    the up to ``window`` observations before those, empty while ``observations <= window``.
    """
    observations = pl.col("observations")
    empty_previous = (observations > 0) & (observations <= window)
    columns = {key: pl.col(key) for key in AGGREGATES}
    nonfinite = pl.concat_str(
        [
            pl.when(expr.is_not_null() & ~expr.is_finite()).then(pl.lit(key))
            for key, expr in columns.items()
        ],
        separator=", ",
        ignore_nulls=True,
    )
    window_reason = pl.when(empty_previous).then(
        pl.format(
            "previous_window_mean has no observations: all {} are in the recent window of {}",
            observations,
            pl.lit(window),
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
            for key, expr in columns.items()
        ),
        pl.when(reason != "").then(reason).alias("unavailable_reason"),
    )


_ENCODE: Final = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode
"""Strict JSON (raises ValueError on NaN/Infinity); one line per call, Python's C encoder."""
_STATISTIC_TEMPLATE: Final[str] = (
    "%s{" + ", ".join(f"{json.dumps(key)}: %s" for key in STATISTIC_KEYS) + "}"
)

_TENSOR_TEMPLATE: Final[str] = (
    '{"call_index": %d, "signal": %s, "tensor_path": %s, "mode": %s, "grad_enabled": %s, '
    '"latest_shape": %s, "dtype": %s, "statistics": {'
)
"""A tensor object up to its statistics, as ``json`` would encode it (key order, separators)."""


def _json_values(values: list[Any]) -> list[str]:
    """JSON text of each value (floats, ints or None), from one C-encoder call: a number or
    ``null`` never contains ``", "``, so the encoded list splits back into its items."""
    return _ENCODE(values)[1:-1].split(", ")


def _ordered(finished: pl.DataFrame, layers: Sequence[str], metrics: Sequence[str]) -> pl.DataFrame:
    """Rows in result.json order: catalog layers in catalog order, then layers only the
    history names (by name); tensors by call, signal (contract order), path, mode,
    grad_enabled; metrics in the run's order, then by name."""
    layer_order = pl.DataFrame(
        {"layer": list(layers), "_layer": list(range(len(layers)))},
        schema={"layer": pl.String, "_layer": pl.Int64},
    )
    signal_order = pl.DataFrame(
        {"signal": list(SIGNALS), "_signal": list(range(len(SIGNALS)))},
        schema={"signal": pl.String, "_signal": pl.Int64},
    )
    metric_order = pl.DataFrame(
        {"metric": list(metrics), "_metric": list(range(len(metrics)))},
        schema={"metric": pl.String, "_metric": pl.Int64},
    )
    return (
        finished.lazy()
        .join(layer_order.lazy(), on="layer", how="left")
        .join(signal_order.lazy(), on="signal", how="left")
        .join(metric_order.lazy(), on="metric", how="left")
        .with_columns(
            pl.col("_layer").fill_null(len(layers)),
            pl.col("_signal").fill_null(len(SIGNALS)),
            pl.col("_metric").fill_null(len(metrics)),
        )
        .sort(
            "_layer",
            "layer",
            "call_index",
            "_signal",
            "tensor_path",
            "mode",
            "grad_enabled",
            "_metric",
            "metric",
        )
        .collect()
    )


def render(
    catalog: Iterable[LayerLike],
    aggregated: pl.DataFrame | None,
    *,
    window: int,
    metrics: Sequence[str] = (),
) -> str:
    """result.json's text: one record per line for every catalog layer in catalog order
    (executed or not), then any layer that only the history names, each with its tensors and
    per-metric statistics.

    The 18,000 statistics objects of a 1,000-layer model are formatted from columns (one C
    encoder call per aggregate column, then one string template per object) rather than
    built as Python dicts and encoded one by one.
    """
    heads: dict[str, tuple[str, list[str]]] = {}
    for info in catalog:
        if info.name not in heads:
            heads[info.name] = (info.module_type, list(info.aliases))
    tensors: dict[str, list[str]] = {name: [] for name in heads}
    if aggregated is not None and aggregated.height:
        rows = _ordered(finish_statistics(aggregated, window), list(heads), metrics)
        _render_tensors(rows, heads, tensors)
    lines = [
        _ENCODE({"layer": name, "type": module_type, "aliases": aliases})[:-1]
        + ', "tensors": ['
        + ", ".join(tensors[name])
        + "]}"
        for name, (module_type, aliases) in heads.items()
    ]
    if not lines:
        return "[]\n"
    return "[\n" + ",\n".join(lines) + "\n]\n"


def _render_tensors(
    rows: pl.DataFrame, heads: dict[str, tuple[str, list[str]]], tensors: dict[str, list[str]]
) -> None:
    """Append each tensor's JSON object (rows ordered by :func:`_ordered`) to ``tensors``.

    Few tracked Python objects per row (no dict, list or kept tuple): allocating containers
    by the ten thousand triggers the garbage collector, which then walks every object of the
    training process (a 1,000-layer model is a large graph).
    """
    # Reasons, metric names: few distinct strings, each encoded once.
    reason_column = rows.get_column("unavailable_reason").to_list()
    encoded = {r: "null" if r is None else _ENCODE(r) for r in set(reason_column)}
    metric_column = rows.get_column("metric").to_list()
    metric_keys = {m: _ENCODE(m) + ": " for m in set(metric_column)}
    statistics = [
        _STATISTIC_TEMPLATE % fields
        for fields in zip(
            [metric_keys[m] for m in metric_column],
            rows.get_column("observations").cast(pl.String).to_list(),
            rows.get_column("unavailable").cast(pl.String).to_list(),
            *(_json_values(rows.get_column(key).to_list()) for key in AGGREGATES),
            [encoded[r] for r in reason_column],
            strict=True,
        )
    ]
    keys = list(TENSOR_KEYS)
    changed = pl.any_horizontal([pl.col(k).ne_missing(pl.col(k).shift(1)) for k in keys])
    changed = changed.fill_null(True)
    starts = rows.select(changed.arg_true()).to_series().to_list()
    firsts = rows.filter(changed).select([*keys, "latest_shape", "dtype", "module_type"]).rows()
    strings: dict[str | None, str] = {}  # signals, paths, modes, dtypes: few distinct values
    for number, first in enumerate(firsts):
        layer, call_index, signal, tensor_path, mode, grad_enabled = first[:6]
        latest_shape, dtype, module_type = first[6:]
        for text in (signal, tensor_path, mode, dtype):
            if text not in strings:
                strings[text] = _ENCODE(text)
        head = _TENSOR_TEMPLATE % (
            int(call_index),
            strings[signal],
            strings[tensor_path],
            strings[mode],
            "true" if grad_enabled else "false",
            _ENCODE([int(s) for s in latest_shape or []]),
            strings[dtype],
        )
        if layer not in tensors:
            heads[layer] = (module_type, [])
            tensors[layer] = []
        end = starts[number + 1] if number + 1 < len(starts) else len(statistics)
        tensors[layer].append(head + ", ".join(statistics[starts[number] : end]) + "}}")


def write_result_json(path: Path, text: str) -> None:
    """Publish result.json (the text of :func:`render`) atomically."""
    publish_text(path, text)
