"""What ``ti summary`` reports about one run, as a Polars frame (live or finalized)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from ti_io.facts import read_catalog, read_run_facts
from ti_io.read.aggregates import AGGREGATES, aggregate
from ti_io.read.filters import apply, matching_layers, row_filter
from ti_io.read.history import scan_history
from ti_io.read.ordering import TENSOR_KEYS, ordered


def display_name(name: str) -> str:
    """A layer name safe to print in a terminal: control characters escaped, root shown."""
    if not name:
        return "(root)"
    if name.isprintable():
        return name
    return json.dumps(name, ensure_ascii=False)[1:-1]


def summary_table(
    directory: Path,
    metrics: Sequence[str] = (),
    signals: Sequence[str] = (),
    layers: Sequence[str] = (),
) -> pl.DataFrame:
    """One row per tensor, context and metric (``TENSOR_KEYS``, ``metric``, ``latest_sample``,
    ``latest``, every result.json aggregate, ``executed`` true), then one row per catalog layer
    that never ran (``executed`` false, everything else null). Rows in the run's order
    (:mod:`ti_io.read.ordering`: signals in the contract's order). ``layers`` are
    globs; ``metrics`` and ``signals`` names (empty: all); layer names are unescaped.

    Raises ``ValueError`` when no layer matches ``layers``.
    """
    facts = read_run_facts(directory)
    history = scan_history(directory)
    catalog = [info.name for info in facts.layers or read_catalog(directory) or ()]
    chosen: list[str] | None = None
    if layers:
        present = history.select(pl.col("layer").unique()).collect().get_column("layer")
        known = list(dict.fromkeys([*catalog, *present.to_list()]))
        chosen = matching_layers(known, layers)
        if not chosen:
            raise ValueError(
                f"--layer {' '.join(map(repr, layers))} matches no layer of {directory}; it holds "
                + ", ".join(display_name(n) for n in known[:8])
                + (", ..." if len(known) > 8 else "")
            )
        catalog = [name for name in catalog if name in chosen]
    history = apply(
        history,
        row_filter(layers=chosen, signals=list(signals) or None, metrics=list(metrics) or None),
    )
    keys = [*TENSOR_KEYS, "metric"]
    latest = history.group_by(keys).agg(
        pl.col("value").sort_by("sample_id").last().alias("latest"),
        pl.col("sample_id").max().alias("latest_sample"),
    )
    table = (
        aggregate(history, facts.window)  # the run's window: run.json live, the footer after
        .join(latest, on=keys, how="left")
        .select(*keys, "latest_sample", "latest", "observations", "unavailable", *AGGREGATES)
        .with_columns(pl.lit(True).alias("executed"))
        .collect()
    )
    executed = set(table.get_column("layer").to_list())
    # A finalized run no longer holds run.json: ordered() falls back to the contract's metrics.
    table = ordered(table, layers=catalog, metrics=facts.metrics)
    missing = [name for name in catalog if name not in executed]
    if missing:
        unexecuted = pl.DataFrame(
            {"layer": missing, "executed": [False] * len(missing)},
            schema={"layer": pl.String, "executed": pl.Boolean},
        )
        table = pl.concat([table, unexecuted], how="diagonal_relaxed")
    return table
