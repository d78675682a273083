"""Matched runs side by side: ``compare_runs`` (a table) and ``compare_series`` (per sample).

The research workflow (docs/research-workflow.md) trains matched runs (baseline, broken,
fixed) and compares the same series across them. Both functions read each run's history
(``scan_history``: finalized or live) and line the runs up **by sample id**:

- only sample ids that every run sampled are compared (*shared samples*);
- each measurement (``layer``, ``call_index``, ``signal``, ``tensor_path``, ``mode``,
  ``grad_enabled``, ``metric``) is compared over the shared samples at which any run recorded
  it, so a run that stopped recording it (a gradient that no longer arrives) shows missing
  values there instead of a shorter, misaligned series.

Runs need not hold the same layers, metrics or contract minor version: what they share is
compared, and a measurement some run lacks keeps its rows, marked ``in_run = False`` for
that run (never dropped). Runs of another contract major, or written by torchinstruments
0.8.0, are refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import polars as pl
import pyarrow.parquet as pq

from ti_io.facts import read_catalog, read_run_facts
from ti_io.read.filters import matching_layers, names, row_filter, signal_names
from ti_io.read.frames import plain_strings
from ti_io.read.history import scan_history
from ti_io.read.legacy_layout import check_not_legacy
from ti_io.read.ordering import GROUP_KEYS, ordered
from ti_schema import DEFAULT_METRICS, check_compatible
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, list_parts, list_rank_dirs

KEY: Final[tuple[str, ...]] = GROUP_KEYS
"""One measurement: ``layer``, ``call_index``, ``signal``, ``tensor_path``, ``mode``,
``grad_enabled``, ``metric`` (the grouping of result.json)."""

RunPath = str | os.PathLike[str]
Runs = Sequence[RunPath] | Mapping[str, RunPath]
"""Run directories in order, labelled by name, or ``{label: directory}``."""


@dataclass(frozen=True)
class ComparedRun:
    """One run of a comparison: its label, where it is and what it holds."""

    label: str
    directory: Path
    finalized: bool
    """True once ``history.parquet`` exists; False for a live or interrupted run (parts)."""
    contract_version: str | None
    """``major.minor`` of the ``ti`` contract its history was written with (None: no rows yet)."""
    samples: tuple[int, ...]
    """Every sample id in its history, ascending."""
    window: int
    """The window of its result.json window means (a run fact)."""


def open_runs(runs: Runs) -> list[ComparedRun]:
    """Check and describe the runs to compare, in order (the first is the reference).

    Raises ``ValueError`` for fewer than two runs or a run given twice, ``FileNotFoundError``
    for a path that does not exist or a directory that holds no run (or holds ``rank-NNN``
    runs: pass one rank's directory), ``ti_io.LegacyRunError`` for a torchinstruments 0.8.0
    run and ``ti_schema.SchemaMismatchError`` for another contract major.
    """
    labelled = _labelled(runs)
    opened = []
    for label, path in labelled.items():
        directory = Path(path)
        if not directory.exists():
            raise FileNotFoundError(
                f"run {label!r}: {directory} does not exist; pass run directories (an "
                "output_dir holding history.parquet or history.parts/)"
            )
        if not directory.is_dir():
            raise NotADirectoryError(f"run {label!r}: {directory} is a file, not a run directory")
        check_not_legacy(directory, "compared")
        ranks = list_rank_dirs(directory)
        if ranks and not (directory / HISTORY_FILE).is_file():
            names = ", ".join(child.name for _, child in ranks[:4])
            raise FileNotFoundError(
                f"run {label!r}: {directory} holds rank-private runs ({names}"
                f"{', ...' if len(ranks) > 4 else ''}); compare one rank's directory, e.g. "
                f"{directory / ranks[0][1].name}"
            )
        history = _scan(directory)  # FileNotFoundError naming what is missing
        samples = history.select(pl.col("sample_id").unique().sort()).collect()
        opened.append(
            ComparedRun(
                label=label,
                directory=directory,
                finalized=(directory / HISTORY_FILE).is_file(),
                contract_version=_contract_version(directory),
                samples=tuple(samples.get_column("sample_id").to_list()),
                window=read_run_facts(directory).window,
            )
        )
    return opened


def compare_runs(
    runs: Runs,
    *,
    layer: str | Sequence[str] | None = None,
    signal: str | Sequence[str] | None = None,
    metric: str | Sequence[str] | None = None,
    onset: int | None = None,
    window: int | None = None,
) -> pl.DataFrame:
    """Every measurement of two or more runs side by side: one row per measurement and run.

    ``runs``: run directories (labelled by their names, made unique by parent folders) or
    ``{label: directory}``; the first run is the reference of the ratios. ``layer``: glob
    patterns (``"encoder.*"``, ``fnmatch`` rules, case-sensitive); ``signal``, ``metric``:
    names. ``onset``: a sample id; adds the means before and after it. ``window``: samples in
    each window mean (default: the first run's result.json window).

    Columns: the measurement (``layer``, ``call_index``, ``signal``, ``tensor_path``, ``mode``,
    ``grad_enabled``, ``metric``); ``run`` (its label); ``in_run`` (False: this run has no row
    of this measurement at all; its values are null); ``samples`` (shared samples at which any
    run recorded the measurement) and ``measured`` (of those, the ones with a value in this
    run); ``latest_sample`` and ``latest`` (the value there, null when this run has none);
    ``recent_window_mean`` (the last ``window`` of those samples) and
    ``previous_window_mean`` (the ``window`` before them); with ``onset``: ``before_mean``,
    ``after_mean`` (samples ``< onset`` / ``>= onset``), ``samples_after``,
    ``measured_after``; ``latest_ratio``, ``recent_ratio`` and, with ``onset``,
    ``after_ratio``: this run's value divided by the first run's (null where the first run's
    value is 0 or missing). Means skip missing values. Rows are ordered by layer (as the runs'
    catalogs list them), call, signal, tensor path, context, metric, then run.

    Raises ``ValueError`` when no layer or metric matches the filters, when the runs share no
    layer, no measurement or no sample id, or when a run holds two rows for one measurement
    and sample; see :func:`open_runs` for the errors about the runs themselves.
    """
    if onset is not None and (isinstance(onset, bool) or not isinstance(onset, int)):
        raise TypeError(f"onset must be a sample id (an int >= 0), got {onset!r}")
    if onset is not None and onset < 0:
        raise ValueError(f"onset must be a sample id (an int >= 0), got {onset}")
    opened = open_runs(runs)
    size = _window(window, opened)
    cells, present, labels = _cells(opened, layer=layer, signal=signal, metric=metric)
    ordinal = pl.col("sample_id").rank("ordinal", descending=True).over([*KEY, "_run"])
    # In sample order within each group: the means add up in one order, so the same runs give
    # the same bits every time.
    value = pl.col("value").sort_by("sample_id")
    back = pl.col("_back").sort_by("sample_id")
    sample = pl.col("sample_id").sort()
    stats = [
        pl.len().cast(pl.Int64).alias("samples"),
        value.count().cast(pl.Int64).alias("measured"),
        sample.max().alias("latest_sample"),
        value.last().alias("latest"),
        value.filter(back <= size).mean().alias("recent_window_mean"),
        value.filter((back > size) & (back <= 2 * size)).mean().alias("previous_window_mean"),
    ]
    if onset is not None:
        before, after = sample < onset, sample >= onset
        stats += [
            value.filter(before).mean().alias("before_mean"),
            value.filter(after).mean().alias("after_mean"),
            after.sum().cast(pl.Int64).alias("samples_after"),
            value.filter(after).count().cast(pl.Int64).alias("measured_after"),
        ]
    aggregated = cells.with_columns(ordinal.alias("_back")).group_by([*KEY, "_run"]).agg(stats)
    table = (
        present.join(aggregated, on=[*KEY, "_run"], how="left")
        .with_columns(
            pl.col("samples").fill_null(0),
            pl.col("measured").fill_null(0),
            *(
                [pl.col("samples_after").fill_null(0), pl.col("measured_after").fill_null(0)]
                if onset is not None
                else []
            ),
        )
        .collect()
    )
    ratios = {"latest": "latest_ratio", "recent_window_mean": "recent_ratio"}
    if onset is not None:
        ratios["after_mean"] = "after_ratio"
    reference = table.filter(pl.col("_run") == 0).select(
        *KEY, *(pl.col(stat).alias(f"_ref_{stat}") for stat in ratios)
    )
    table = table.join(reference, on=list(KEY), how="left").with_columns(
        pl.when(pl.col(f"_ref_{stat}") != 0).then(pl.col(stat) / pl.col(f"_ref_{stat}")).alias(name)
        for stat, name in ratios.items()
    )
    table = _ordered(table, opened).with_columns(
        pl.col("_run").replace_strict(dict(enumerate(labels)), return_dtype=pl.String).alias("run")
    )
    onset_columns = (
        ["before_mean", "after_mean", "samples_after", "measured_after"]
        if onset is not None
        else []
    )
    return table.select(
        *KEY,
        "run",
        "in_run",
        "samples",
        "measured",
        "latest_sample",
        "latest",
        "recent_window_mean",
        "previous_window_mean",
        *onset_columns,
        *ratios.values(),
    )


def compare_series(
    runs: Runs,
    *,
    layer: str | Sequence[str] | None = None,
    signal: str | Sequence[str] | None = None,
    metric: str | Sequence[str] | None = None,
) -> pl.DataFrame:
    """The aligned samples behind :func:`compare_runs`: one row per measurement, run and
    shared sample at which any run recorded the measurement.

    Columns: the measurement columns, ``run``, ``sample_id``, ``forward_index`` (the run's
    root forward of that sample) and ``value``, null where this run wrote nothing for that
    sample (a gap, never a zero; a run without the measurement has only gaps). Sorted like
    :func:`compare_runs`, then by ``sample_id``. Same arguments and errors as
    :func:`compare_runs`.
    """
    opened = open_runs(runs)
    cells, _, labels = _cells(opened, layer=layer, signal=signal, metric=metric)
    forwards = pl.concat(
        [
            _scan(run.directory)
            .select("sample_id", "forward_index")
            .unique(subset="sample_id")
            .with_columns(pl.lit(i, dtype=pl.Int32).alias("_run"))
            for i, run in enumerate(opened)
        ]
    )
    series = cells.join(forwards, on=["sample_id", "_run"], how="left").collect()
    series = _ordered(series, opened, extra=("sample_id",)).with_columns(
        pl.col("_run").replace_strict(dict(enumerate(labels)), return_dtype=pl.String).alias("run")
    )
    return series.select(*KEY, "run", "sample_id", "forward_index", "value")


def unshared(table: pl.DataFrame) -> pl.DataFrame:
    """The measurements of a :func:`compare_runs` table that some run lacks: one row per
    measurement, with ``in_runs`` and ``missing_in`` (lists of run labels, in run order)."""
    # compare_runs orders the runs within each measurement; group_by keeps that order.
    lacking = table.group_by(list(KEY), maintain_order=True).agg(
        pl.col("run").filter(pl.col("in_run")).alias("in_runs"),
        pl.col("run").filter(~pl.col("in_run")).alias("missing_in"),
    )
    return lacking.filter(pl.col("missing_in").list.len() > 0)


# --- internals ----------------------------------------------------------------------------------


def _labelled(runs: Runs) -> dict[str, RunPath]:
    if isinstance(runs, Mapping):
        labelled = dict(runs)
        for label in labelled:
            if not isinstance(label, str) or not label:
                raise TypeError(f"run labels must be non-empty strings, got {label!r}")
    elif isinstance(runs, str | bytes | os.PathLike) or not isinstance(runs, Sequence):
        raise TypeError(
            "runs must be a sequence of run directories or a {label: directory} mapping, got "
            f"{runs!r}; e.g. compare_runs(['runs/baseline', 'runs/broken'])"
        )
    else:
        paths = list(runs)
        resolved = [Path(p).resolve() for p in paths]
        if len(set(resolved)) != len(resolved):
            twice = next(
                str(p) for p, r in zip(paths, resolved, strict=True) if resolved.count(r) > 1
            )
            raise ValueError(f"runs names {twice} twice; pass each run once")
        labelled = dict(zip(_unique_labels([Path(p) for p in paths]), paths, strict=True))
    if len(labelled) < 2:
        raise ValueError(f"compare two or more runs, got {len(labelled)}")
    return labelled


def _unique_labels(paths: list[Path]) -> list[str]:
    """Directory names, lengthened by parent folders until they differ (``a/stats``)."""
    parts = [p.resolve().parts for p in paths]
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            return labels
        depth += 1


def _scan(directory: Path) -> pl.LazyFrame:
    return plain_strings(scan_history(directory), check=True)


def _contract_version(directory: Path) -> str | None:
    final = directory / HISTORY_FILE
    files = [final] if final.is_file() else list_parts(directory / HISTORY_PARTS)[:1]
    if not files:
        return None
    major, minor = check_compatible(pq.read_metadata(files[0]).metadata)
    return f"{major}.{minor}"


def _window(window: int | None, opened: list[ComparedRun]) -> int:
    if window is None:
        return opened[0].window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (samples per window mean), got {window!r}")
    return window


def _distinct(scans: list[pl.LazyFrame], column: str) -> list[list[str]]:
    return [
        scan.select(pl.col(column).unique()).collect().get_column(column).to_list()
        for scan in scans
    ]


def _filters(
    opened: list[ComparedRun],
    scans: list[pl.LazyFrame],
    *,
    layer: str | Sequence[str] | None,
    signal: str | Sequence[str] | None,
    metric: str | Sequence[str] | None,
) -> pl.Expr | None:
    """The row filter for ``layer`` globs, ``signal`` and ``metric`` names, checked against
    what the runs hold; then that the runs share a layer."""
    layers_per_run = _distinct(scans, "layer")
    patterns = names(layer, "layer")
    matched: list[str] | None = None
    if patterns is not None:
        known = sorted({n for layers in layers_per_run for n in layers})
        matched = matching_layers(known, patterns)
        if not matched:
            raise ValueError(
                f"layer {patterns} matches no layer of any run; the runs hold {_preview(known)}"
            )
        layers_per_run = [[n for n in layers if n in matched] for layers in layers_per_run]
    signals = signal_names(signal)
    metrics = names(metric, "metric")
    if metrics is not None:
        held = {m for found in _distinct(scans, "metric") for m in found}
        if not held & set(metrics):
            raise ValueError(
                f"metric {metrics} matches no metric of any run; the runs hold "
                f"{_preview(sorted(held))}"
            )
    shared_layers = set.intersection(*(set(layers) for layers in layers_per_run))
    if not shared_layers:
        held_by = "; ".join(
            f"{run.label}: {_preview(sorted(layers))}"
            for run, layers in zip(opened, layers_per_run, strict=True)
        )
        raise ValueError(f"the runs share no layer ({held_by}); compare runs of the same model")
    return row_filter(layers=matched, signals=signals, metrics=metrics)


def _cells(
    opened: list[ComparedRun],
    *,
    layer: str | Sequence[str] | None,
    signal: str | Sequence[str] | None,
    metric: str | Sequence[str] | None,
) -> tuple[pl.LazyFrame, pl.LazyFrame, list[str]]:
    """The aligned grid (measurement x run x sample, ``value`` null where nothing was written),
    every (measurement, run) pair with ``in_run``, and the run labels."""
    scans = [_scan(run.directory) for run in opened]
    condition = _filters(opened, scans, layer=layer, signal=signal, metric=metric)
    shared = sorted(set.intersection(*(set(run.samples) for run in opened)))
    if not shared:
        spans = "; ".join(f"{run.label}: {_span(run.samples)}" for run in opened)
        raise ValueError(f"the runs share no sample id ({spans}); nothing lines up")
    labels = [run.label for run in opened]
    runs = pl.LazyFrame({"_run": list(range(len(opened)))}, schema={"_run": pl.Int32})
    frames = []
    for i, scan in enumerate(scans):
        if condition is not None:
            scan = scan.filter(condition)
        frames.append(
            scan.select(*KEY, "sample_id", pl.col("value").cast(pl.Float64)).with_columns(
                pl.lit(i, dtype=pl.Int32).alias("_run")
            )
        )
    rows = pl.concat(frames, how="vertical")
    keys = rows.group_by(list(KEY)).agg(pl.col("_run").unique().alias("_runs"))
    present = keys.join(runs, how="cross").with_columns(
        pl.col("_runs").list.contains(pl.col("_run")).alias("in_run")
    )
    shared_keys = keys.filter(pl.col("_runs").list.len() == len(opened)).select(pl.len()).collect()
    if shared_keys.item() == 0:
        raise ValueError(
            "the runs share no measurement (layer, call, signal, tensor path, context and metric "
            "all equal); narrow or widen the filters, or compare runs of the same model"
        )
    aligned = rows.filter(pl.col("sample_id").is_in(shared))
    counted = aligned.group_by([*KEY, "_run", "sample_id"]).agg(
        pl.col("value").first(), pl.len().alias("_n")
    )
    duplicated = counted.filter(pl.col("_n") > 1).head(1).collect()
    if duplicated.height:
        row = duplicated.row(0, named=True)
        raise ValueError(
            f"run {labels[row['_run']]!r} holds {row['_n']} rows for one measurement at sample "
            f"{row['sample_id']} (layer={row['layer']!r}, signal={row['signal']!r}, "
            f"metric={row['metric']!r}); it mixes several runs: compare one run per directory"
        )
    grid = (
        counted.select(*KEY, "sample_id")
        .unique()
        .join(runs, how="cross")
        .join(counted.drop("_n"), on=[*KEY, "_run", "sample_id"], how="left")
    )
    return grid, present.drop("_runs"), labels


def _ordered(
    table: pl.DataFrame, opened: list[ComparedRun], *, extra: tuple[str, ...] = ()
) -> pl.DataFrame:
    """In the runs' row order (:mod:`ti_io.read.ordering`: layers as the runs' catalogs list
    them, metrics in the default profile's order, runs may differ), then run and ``extra``."""
    layer_order: dict[str, int] = {}
    for run in opened:
        for info in read_catalog(run.directory) or ():
            layer_order.setdefault(info.name, len(layer_order))
    return ordered(table, layers=list(layer_order), metrics=DEFAULT_METRICS, then=("_run", *extra))


def _preview(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]" if names else "nothing"


def _span(samples: Sequence[int]) -> str:
    return f"samples {samples[0]}..{samples[-1]}" if samples else "no samples"
