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

import fnmatch
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ti_io.facts import read_catalog, read_run_facts
from ti_io.progress import ProgressCallback, Steps
from ti_io.read.alignment import Alignment, DuplicateRowError, aligned_statistics
from ti_io.read.filters import matching_layers, names, signal_names
from ti_io.read.history import history_files_of
from ti_io.read.keys import KeyCatalog
from ti_io.read.legacy_layout import check_not_legacy
from ti_io.read.ordering import GROUP_KEYS, ordered
from ti_io.read.row_groups import HistoryFiles, read_row_groups
from ti_io.read.spill import Partitions, partition_count
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


def open_runs(runs: Runs, *, minimum: int = 2) -> list[ComparedRun]:
    """Check and describe the runs to compare, in order (the first is the reference).

    Raises ``ValueError`` for fewer than ``minimum`` runs or a run given twice,
    ``FileNotFoundError`` for a path that does not exist or a directory that holds no run (or
    holds ``rank-NNN`` runs: pass one rank's directory), ``ti_io.LegacyRunError`` for a
    torchinstruments 0.8.0 run and ``ti_schema.SchemaMismatchError`` for another contract
    major.
    """
    labelled = _labelled(runs, minimum)
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
        files = history_files_of(directory)  # FileNotFoundError naming what is missing
        opened.append(
            ComparedRun(
                label=label,
                directory=directory,
                finalized=files.final,
                contract_version=_contract_version(directory),
                samples=tuple(_sample_ids(files).tolist()),
                window=read_run_facts(directory).window,
            )
        )
    return opened


def _sample_ids(files: HistoryFiles) -> npt.NDArray[np.int64]:
    """Every sample id of the history ``files``, ascending (one column read, a row group at a
    time)."""
    found = [
        pc.unique(group.table.column("sample_id")).to_numpy()
        for group in read_row_groups(files.paths, ["sample_id"])
    ]
    return np.unique(np.concatenate(found)) if found else np.array([], dtype=np.int64)


def compare_runs(
    runs: Runs,
    *,
    layer: str | Sequence[str] | None = None,
    signal: str | Sequence[str] | None = None,
    metric: str | Sequence[str] | None = None,
    onset: int | None = None,
    window: int | None = None,
    progress: ProgressCallback | None = None,
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
    ratios = _RATIOS if onset is None else {**_RATIOS, "after_mean": "after_ratio"}
    with _Partitioned(
        opened, layer=layer, signal=signal, metric=metric, progress=progress
    ) as partitioned:
        alignment = Alignment(np.asarray(partitioned.shared, np.int64), len(opened), size, onset)
        pieces = list(partitioned.statistics(alignment))
        table = _with_ratios(pl.concat(pieces), ratios)
        table = partitioned.decoded(table)
    table = _ordered(table, opened).with_columns(
        pl.col("_run")
        .replace_strict(dict(enumerate(partitioned.labels)), return_dtype=pl.String)
        .alias("run")
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


_RATIOS: Final[dict[str, str]] = {"latest": "latest_ratio", "recent_window_mean": "recent_ratio"}


def _with_ratios(table: pl.DataFrame, ratios: dict[str, str]) -> pl.DataFrame:
    """``table`` with each statistic of ``ratios`` divided by the first run's (null where the
    first run's value is 0 or missing)."""
    reference = table.filter(pl.col("_run") == 0).select(
        "key", *(pl.col(stat).alias(f"_ref_{stat}") for stat in ratios)
    )
    return (
        table.join(reference, on="key", how="left")
        .with_columns(
            pl.when(pl.col(f"_ref_{stat}") != 0)
            .then(pl.col(stat) / pl.col(f"_ref_{stat}"))
            .alias(name)
            for stat, name in ratios.items()
        )
        .drop(f"_ref_{stat}" for stat in ratios)
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
    with _Partitioned(opened, layer=layer, signal=signal, metric=metric, forwards=True) as parts:
        pieces = [cells for cells, _ in parts.partitions()]
        series = parts.decoded(pl.concat(pieces))
    series = _ordered(series, opened, extra=("sample_id",)).with_columns(
        pl.col("_run")
        .replace_strict(dict(enumerate(parts.labels)), return_dtype=pl.String)
        .alias("run")
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


def _labelled(runs: Runs, minimum: int) -> dict[str, RunPath]:
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
    if len(labelled) < minimum:
        wanted = "two or more runs" if minimum == 2 else f"at least {minimum} run(s)"
        raise ValueError(f"compare {wanted}, got {len(labelled)}")
    return labelled


def _unique_labels(paths: list[Path]) -> list[str]:
    """Directory names, lengthened by parent folders until they differ (``a/stats``)."""
    return unique_labels([p.resolve().parts for p in paths])


def unique_labels(parts: Sequence[Sequence[str]]) -> list[str]:
    """Labels of runs given as their paths' parts: the last part of each, lengthened by the
    parts before it until the labels differ (``a/stats``)."""
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            return labels
        depth += 1


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


_CELLS: Final[pa.Schema] = pa.schema(
    [
        pa.field("key", pa.uint32(), nullable=False),
        pa.field("_run", pa.int32(), nullable=False),
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("value", pa.float64()),
    ]
)
_READ: Final[list[str]] = [*KEY, "sample_id", "value"]


class _Partitioned:
    """The rows of the compared runs, read once a row group at a time and routed by
    measurement into partitions (:mod:`ti_io.read.spill`), so each measurement's rows of every
    run are compared in memory one partition at a time; a context manager (the partitions'
    files are removed on exit).

    The selection (``layer`` globs, ``signal``, ``metric``) is checked against what the runs
    hold before anything is aggregated: ``ValueError`` when nothing matches, when the runs
    share no layer, no measurement or no sample id. ``forwards``: also carry each row's
    ``forward_index`` (:func:`compare_series`).
    """

    def __init__(
        self,
        opened: list[ComparedRun],
        *,
        layer: str | Sequence[str] | None,
        signal: str | Sequence[str] | None,
        metric: str | Sequence[str] | None,
        forwards: bool = False,
        progress: ProgressCallback | None = None,
    ) -> None:
        self.labels = [run.label for run in opened]
        self._opened = opened
        self._forwards = forwards
        patterns = names(layer, "layer")
        signals = set(signal_names(signal) or ())
        metrics = set(names(metric, "metric") or ())

        def keep(key: tuple[Any, ...]) -> bool:
            name, _, signal_name, _, _, _, metric_name = key
            return (
                (patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns))
                and (not signals or signal_name in signals)
                and (not metrics or metric_name in metrics)
            )

        self._catalog = KeyCatalog(KEY, keep)
        files = [history_files_of(run.directory) for run in opened]
        total = sum(f.total_rows for f in files)
        self._steps = Steps(progress, 2 * total)
        self._partitions = Partitions(_CELLS, partition_count(total))
        self._forward_pairs: list[pl.DataFrame] = []
        self._held: list[set[int]] = []  # per run: the ids of the measurements it holds
        for run, history in enumerate(files):
            self._held.append(self._read(run, history))
        self._check(patterns, metrics)
        self.shared = sorted(set.intersection(*(set(run.samples) for run in opened)))
        if not self.shared:
            spans = "; ".join(f"{run.label}: {_span(run.samples)}" for run in opened)
            raise ValueError(f"the runs share no sample id ({spans}); nothing lines up")

    def __enter__(self) -> _Partitioned:
        return self

    def __exit__(self, *exc: object) -> None:
        self._partitions.close()

    def _read(self, run: int, files: HistoryFiles) -> set[int]:
        held = np.zeros(0, dtype=bool)
        columns = [*_READ, "forward_index"] if self._forwards else _READ
        forwards: list[pl.DataFrame] = []
        for group in read_row_groups(files.paths, columns):
            self._steps.advance(group.table.num_rows)
            ids = self._catalog.ids(group.table.select(list(KEY)))
            seen = np.bincount(ids, minlength=len(held)) > 0
            seen[: len(held)] |= held
            held = seen
            if self._forwards:
                pairs = pl.from_arrow(group.table.select(["sample_id", "forward_index"]))
                assert isinstance(pairs, pl.DataFrame)
                forwards.append(pairs.unique())
            mask = self._catalog.kept[ids]
            if not mask.any():
                continue
            chosen = pa.array(mask)
            arrays = [
                pa.array(ids[mask]),
                pa.array(np.full(int(mask.sum()), run, dtype=np.int32)),
                group.table.column("sample_id").filter(chosen).combine_chunks(),
                group.table.column("value").filter(chosen).combine_chunks().cast(pa.float64()),
            ]
            self._partitions.add(pa.record_batch(arrays, schema=_CELLS))
        if forwards:
            # The root forward of each sample of this run (one per sample id).
            pairs = pl.concat(forwards).unique(subset="sample_id", keep="first")
            self._forward_pairs.append(
                pairs.with_columns(pl.lit(run, dtype=pl.Int32).alias("_run"))
            )
        return set(np.flatnonzero(held).tolist())

    def _check(self, patterns: list[str] | None, metrics: set[str]) -> None:
        """The errors of a selection that matches nothing, or of runs that share nothing."""
        catalog = self._catalog.frame()
        layers_per_run = [
            set(catalog.filter(pl.col("key").is_in(sorted(held))).get_column("layer").to_list())
            for held in self._held
        ]
        if patterns is not None:
            known = sorted(set.union(*layers_per_run))
            matched = set(matching_layers(known, patterns))
            if not matched:
                raise ValueError(
                    f"layer {patterns} matches no layer of any run; the runs hold {_preview(known)}"
                )
            layers_per_run = [layers & matched for layers in layers_per_run]
        if metrics:
            held = set(catalog.get_column("metric").to_list())
            if not held & metrics:
                raise ValueError(
                    f"metric {sorted(metrics)} matches no metric of any run; the runs hold "
                    f"{_preview(sorted(held))}"
                )
        if not set.intersection(*layers_per_run):
            held_by = "; ".join(
                f"{run.label}: {_preview(sorted(layers))}"
                for run, layers in zip(self._opened, layers_per_run, strict=True)
            )
            raise ValueError(f"the runs share no layer ({held_by}); compare runs of the same model")
        kept = self._catalog.kept
        shared = set.intersection(*self._held)
        if not any(kept[key] for key in shared):
            raise ValueError(
                "the runs share no measurement (layer, call, signal, tensor path, context and "
                "metric all equal); narrow or widen the filters, or compare runs of the same model"
            )

    def partitions(self) -> Iterator[tuple[pl.DataFrame, pl.DataFrame]]:
        """Each partition as (the aligned grid: measurement x run x shared sample at which any
        run recorded it, ``value`` null where this run wrote nothing; every (measurement, run)
        pair with ``in_run``). Raises ``ValueError`` when a run holds two rows for one
        measurement and sample."""
        runs = pl.DataFrame({"_run": list(range(len(self._opened)))}, schema={"_run": pl.Int32})
        shared = pl.DataFrame({"sample_id": self.shared}, schema={"sample_id": pl.Int64})
        for rows in self._partitions.frames():
            keys = rows.lazy().group_by("key").agg(pl.col("_run").unique().alias("_runs"))
            present = (
                keys.join(runs.lazy(), how="cross")
                .with_columns(pl.col("_runs").list.contains(pl.col("_run")).alias("in_run"))
                .drop("_runs")
                .collect()
            )
            aligned = rows.lazy().join(shared.lazy(), on="sample_id", how="semi")
            counted = (
                aligned.group_by("key", "_run", "sample_id")
                .agg(pl.col("value").first(), pl.len().alias("_n"))
                .collect()
            )
            duplicated = counted.filter(pl.col("_n") > 1).head(1)
            if duplicated.height:
                self._refuse_duplicates(duplicated.row(0, named=True))
            grid = (
                counted.lazy()
                .select("key", "sample_id")
                .unique()
                .join(runs.lazy(), how="cross")
                .join(counted.lazy().drop("_n"), on=["key", "_run", "sample_id"], how="left")
            )
            if self._forward_pairs:
                forwards = pl.concat(self._forward_pairs).lazy()
                grid = grid.join(forwards, on=["sample_id", "_run"], how="left")
            yield grid.collect(), present

    def statistics(self, alignment: Alignment) -> Iterator[pl.DataFrame]:
        """:func:`ti_io.read.alignment.aligned_statistics` of each partition (``key``,
        ``_run``, ``in_run``, the statistics). Raises ``ValueError`` when a run holds two rows
        for one measurement and sample."""
        count = self._partitions.count
        self._steps.advance(self._steps.total // 2 - self._partitions.rows)  # rows not kept
        for rows in self._partitions.frames():
            index = int(rows.item(0, "key")) % count
            self._steps.advance(rows.height)
            try:
                yield aligned_statistics(rows, alignment, index, count)
            except DuplicateRowError as exc:
                self._refuse_duplicates(
                    {"key": exc.key, "_run": exc.run, "sample_id": exc.sample_id, "_n": exc.rows}
                )

    def _refuse_duplicates(self, row: dict[str, Any]) -> None:
        layer, _, signal, _, _, _, metric = self._catalog.key(int(row["key"]))
        raise ValueError(
            f"run {self.labels[row['_run']]!r} holds {row['_n']} rows for one measurement at "
            f"sample {row['sample_id']} (layer={layer!r}, signal={signal!r}, metric={metric!r}); "
            "it mixes several runs: compare one run per directory"
        )

    def decoded(self, table: pl.DataFrame) -> pl.DataFrame:
        """``table`` (with ``key``) with the measurement columns in its place."""
        return self._catalog.frame().join(table, on="key", how="inner").drop("key")


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
