"""The one row order of a run's tables: result.json, ``ti summary``, ``ti compare``.

A measurement is a tensor (``TENSOR_KEYS``: layer, call, signal, tensor path, context) and a
metric (``GROUP_KEYS``). Rows are ordered by layer as the run's catalog lists them (layers only
the rows name come after, by name), call, signal in the contract's order (``ti_schema.SIGNALS``),
tensor path, mode, grad_enabled, then metric in the run's order (its profile;
``DEFAULT_METRICS`` when unknown), custom metrics after by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import polars as pl

from ti_schema import DEFAULT_METRICS, SIGNALS

TENSOR_KEYS: Final[tuple[str, ...]] = (
    "layer",
    "call_index",
    "signal",
    "tensor_path",
    "mode",
    "grad_enabled",
)
"""One measured tensor: the grouping of result.json's tensor objects."""
GROUP_KEYS: Final[tuple[str, ...]] = (*TENSOR_KEYS, "metric")
"""One measurement: a tensor and a metric (the grouping of result.json's statistics)."""


def _rank(column: str, names: Sequence[str]) -> pl.Expr:
    """Each row's position of ``column`` in ``names``; ``len(names)`` for any other value."""
    order = {name: i for i, name in enumerate(dict.fromkeys(names))}
    return (
        pl.col(column)
        .cast(pl.String)
        .replace_strict(order, default=len(order), return_dtype=pl.Int64)
        .alias(f"_{column}_order")
    )


def ordered(
    table: pl.DataFrame,
    *,
    layers: Sequence[str] = (),
    metrics: Sequence[str] = (),
    signals: Sequence[str] = SIGNALS,
    then: Sequence[str] = (),
) -> pl.DataFrame:
    """``table`` (with every ``GROUP_KEYS`` column) in the run's row order (module docstring).

    ``layers``: the catalog's layer names in order; ``metrics``: the run's metrics in order
    (empty: ``DEFAULT_METRICS``); ``signals``: the contract's signals (a test may declare more);
    ``then``: further columns that order rows of one measurement (a run, a sample id).
    """
    ranks = [
        _rank("layer", layers),
        _rank("signal", signals),
        _rank("metric", metrics or DEFAULT_METRICS),
    ]
    helpers = [rank.meta.output_name() for rank in ranks]
    return (
        table.with_columns(ranks)
        .sort(
            "_layer_order",
            "layer",
            "call_index",
            "_signal_order",
            "signal",
            "tensor_path",
            "mode",
            "grad_enabled",
            "_metric_order",
            "metric",
            *then,
        )
        .drop(helpers)
    )
