"""What ``ti summary`` reports about one run, as a Polars frame (live or finalized)."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from ti_io.facts import read_catalog, read_run_facts
from ti_io.progress import ProgressCallback
from ti_io.read.aggregates import AGGREGATES
from ti_io.read.filters import matching_layers
from ti_io.read.history import history_files_of
from ti_io.read.measurements import aggregate_files
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
    *,
    progress: ProgressCallback | None = None,
) -> pl.DataFrame:
    """One row per tensor, context and metric (``TENSOR_KEYS``, ``metric``, ``latest_sample``,
    ``latest``, every result.json aggregate, ``executed`` true), then one row per catalog layer
    that never ran (``executed`` false, everything else null). Rows in the run's order
    (:mod:`ti_io.read.ordering`: signals in the contract's order). ``layers`` are
    globs; ``metrics`` and ``signals`` names (empty: all); layer names are unescaped.

    The history is read once, a row group at a time (:mod:`ti_io.read.measurements`): memory
    does not grow with the run's length; ``progress(done, total)`` is told the rows read and
    aggregated. Raises ``ValueError`` when no layer matches ``layers``,
    ``ti_io.DamagedFileError`` naming a damaged file.
    """
    facts = read_run_facts(directory)
    files = history_files_of(directory)
    catalog = [info.name for info in facts.layers or read_catalog(directory) or ()]
    # The run's window: run.json while live, the footer once finalized.
    keep = _selection(layers, signals, metrics)
    table, measured = aggregate_files(files, facts.window, keep, progress)
    seen = list(dict.fromkeys(measured.frame().get_column("layer").to_list()))
    if layers:
        known = list(dict.fromkeys([*catalog, *seen]))
        chosen = matching_layers(known, layers)
        if not chosen:
            raise ValueError(
                f"--layer {' '.join(map(repr, layers))} matches no layer of {directory}; it holds "
                + ", ".join(display_name(n) for n in known[:8])
                + (", ..." if len(known) > 8 else "")
            )
        catalog = [name for name in catalog if name in chosen]
    keys = [*TENSOR_KEYS, "metric"]
    table = table.select(
        *keys, "latest_sample", "latest", "observations", "unavailable", *AGGREGATES
    ).with_columns(pl.lit(True).alias("executed"))
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


def _selection(
    layers: Sequence[str], signals: Sequence[str], metrics: Sequence[str]
) -> Callable[[tuple[Any, ...]], bool] | None:
    """Whether a measurement (its ``GROUP_KEYS`` tuple) is selected; None selects every one."""
    if not (layers or signals or metrics):
        return None
    signal_set, metric_set = set(signals), set(metrics)

    def keep(key: tuple[Any, ...]) -> bool:
        layer, _, signal, _, _, _, metric = key
        return (
            (not layers or any(fnmatch.fnmatchcase(layer, p) for p in layers))
            and (not signal_set or signal in signal_set)
            and (not metric_set or metric in metric_set)
        )

    return keep
