"""Evidence read back from the written artifacts with Polars: series, tables and CSV.

Everything here reads ``history.parquet`` (through ``ti_io.scan_history``), never the objects of
the training process, so what it shows is exactly what a user finds on disk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import polars as pl

from ti_examples.problems import VARIANTS, Panel, Variant
from ti_io import scan_history

SERIES_COLUMNS = (
    "variant",
    "sample_id",
    "forward_index",
    "after_onset",
    "series",
    "layer",
    "signal",
    "metric",
    "value",
)
"""Columns of the frame behind ``comparison.csv`` and ``comparison.png``."""


def run_series(run_dir: Path, panels: Sequence[Panel]) -> pl.DataFrame:
    """One row per (sampled forward, panel) of one run; ``value`` is null where nothing was written.

    Every sampled forward appears, so a gradient that never arrived is a null row (a gap in the
    plot), never a zero. Panels read call 0 of the bare tensor output (``tensor_path == ""``).
    """
    history = scan_history(run_dir)
    samples = (
        history.filter(pl.col("signal") == "output")
        .select("sample_id", "forward_index")
        .unique()
        .sort("sample_id")
        .collect()
    )
    frames = []
    for panel in panels:
        measured = (
            history.filter(
                (pl.col("layer") == panel.layer)
                & (pl.col("signal") == panel.signal)
                & (pl.col("metric") == panel.metric)
                & (pl.col("call_index") == 0)
                & (pl.col("tensor_path") == "")
            )
            .select("sample_id", "value")
            .collect()
        )
        frames.append(
            samples.join(measured, on="sample_id", how="left").with_columns(
                series=pl.lit(panel.label),
                layer=pl.lit(panel.layer),
                signal=pl.lit(panel.signal),
                metric=pl.lit(panel.metric),
            )
        )
    return pl.concat(frames)


def comparison_frame(
    run_dirs: Mapping[Variant, Path], panels: Sequence[Panel], onset_step: int
) -> pl.DataFrame:
    """The evidence series of every variant, with ``after_onset`` marking faulty forwards."""
    frames = [
        run_series(path, panels).with_columns(variant=pl.lit(variant))
        for variant, path in run_dirs.items()
    ]
    return (
        pl.concat(frames)
        .with_columns(after_onset=pl.col("forward_index") >= onset_step)
        .select(SERIES_COLUMNS)
        .sort("series", "variant", "sample_id")
    )


def onset_sample(frame: pl.DataFrame) -> int:
    """The first sample_id taken at or after the onset step."""
    first = frame.filter(pl.col("after_onset"))["sample_id"].min()
    if first is None:
        raise ValueError("no sample was taken after the fault onset; train for more steps")
    return int(first)  # type: ignore[arg-type]


def evidence_table(frame: pl.DataFrame) -> pl.DataFrame:
    """Per series and variant: median before and after the onset, last value, measured samples.

    ``measured_after`` counts samples after the onset that have a value: ``0/8`` means the
    series stopped (for example, no gradient reached that layer).
    """
    order = {name: i for i, name in enumerate(VARIANTS)}
    return (
        frame.group_by("series", "variant")
        .agg(
            before_onset=pl.col("value").filter(~pl.col("after_onset")).median(),
            after_onset=pl.col("value").filter(pl.col("after_onset")).median(),
            last=pl.col("value").sort_by("sample_id").last(),
            measured=pl.col("value").filter(pl.col("after_onset")).count(),
            samples=pl.col("after_onset").sum(),
        )
        .with_columns(
            measured_after=pl.format("{}/{}", "measured", "samples"),
            _order=pl.col("variant").replace_strict(order, default=len(order)),
        )
        .sort("series", "_order")
        .select("series", "variant", "before_onset", "after_onset", "last", "measured_after")
    )
