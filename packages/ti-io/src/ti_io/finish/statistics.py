"""result.json's statistics objects, formatted from Polars frames of aggregates.

:func:`finish_statistics` applies result.json's null rules to raw aggregates
(:mod:`ti_io.read.aggregates`); :func:`tensor_objects` formats each tensor's JSON object from
the rows, in the run's order (:mod:`ti_io.read.ordering`). A null aggregate always comes with
``unavailable_reason``; NaN and infinity are never written (strict JSON).
"""

from __future__ import annotations

import json
from typing import Any, Final

import polars as pl

from ti_io.read.aggregates import AGGREGATES
from ti_io.read.ordering import TENSOR_KEYS

ENCODE: Final = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode
"""Strict JSON (raises ValueError on NaN/Infinity); one line per call, Python's C encoder."""

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
    return ENCODE(values)[1:-1].split(", ")


def tensor_objects(
    rows: pl.DataFrame, heads: dict[str, tuple[str, list[str]]], tensors: dict[str, list[str]]
) -> None:
    """Append each tensor's JSON object to ``tensors`` (``rows`` in the run's order,
    :func:`ti_io.read.ordering.ordered`; layers the catalog lacks are added to ``heads``).

    Few tracked Python objects per row (no dict, list or kept tuple): allocating containers
    by the ten thousand triggers the garbage collector, which then walks every object of the
    training process (a 1,000-layer model is a large graph).
    """
    # Reasons, metric names: few distinct strings, each encoded once.
    reason_column = rows.get_column("unavailable_reason").to_list()
    encoded = {r: "null" if r is None else ENCODE(r) for r in set(reason_column)}
    metric_column = rows.get_column("metric").to_list()
    metric_keys = {m: ENCODE(m) + ": " for m in set(metric_column)}
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
                strings[text] = ENCODE(text)
        head = _TENSOR_TEMPLATE % (
            int(call_index),
            strings[signal],
            strings[tensor_path],
            strings[mode],
            "true" if grad_enabled else "false",
            ENCODE([int(s) for s in latest_shape or []]),
            strings[dtype],
        )
        if layer not in tensors:
            heads[layer] = (module_type, [])
            tensors[layer] = []
        end = starts[number + 1] if number + 1 < len(starts) else len(statistics)
        tensors[layer].append(head + ", ".join(statistics[starts[number] : end]) + "}}")
