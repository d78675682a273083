"""Evidence read back from the written artifacts with Polars: series, tables and CSV.

Every recorded series is read from ``history.parquet`` (through ``ti_io.scan_history``), never
from the objects of the training process, so what it shows is exactly what a user finds on disk.
The one exception is a loss panel (``problems.LOSS``): the loss the training loop computed at
each sampled step, which no observer records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import polars as pl

from ti_examples.problems import LOSS, VARIANTS, Panel, Variant
from ti_io import scan_history

SERIES_COLUMNS = (
    "variant",
    "sample_id",
    "forward_index",
    "after_onset",
    "series",
    "layer",
    "tensor_path",
    "signal",
    "metric",
    "value",
)
"""Columns of the frame behind ``comparison.csv`` and ``comparison.png``."""


def l2_norms(history: pl.LazyFrame, signal: str) -> pl.LazyFrame:
    """``layer``, ``tensor_path``, ``sample_id``, ``norm``: the L2 norm of each recorded tensor
    of ``signal`` (call 0), over its finite entries, from its mean, std and shape. Over ``n``
    entries ``sum(x**2) = n * (std**2 + mean**2)`` (std is the population std), so
    ``||x||_2 = sqrt(n * (std**2 + mean**2))`` with ``n = prod(shape) * (1 - nonfinite_fraction)``
    (the query index.md offers too)."""

    def metric(name: str) -> pl.Expr:
        return pl.col("value").filter(pl.col("metric") == name).first().alias(name)

    numel = pl.col("shape").first().list.eval(pl.element().product()).list.first()
    return (
        history.filter((pl.col("signal") == signal) & (pl.col("call_index") == 0))
        .group_by("layer", "tensor_path", "sample_id")
        .agg(metric("mean"), metric("std"), metric("nonfinite_fraction"), numel.alias("numel"))
        .with_columns(
            norm=(
                pl.col("numel")
                * (1 - pl.col("nonfinite_fraction"))
                * (pl.col("std") ** 2 + pl.col("mean") ** 2)
            ).sqrt()
        )
        .select("layer", "tensor_path", "sample_id", "norm")
    )


def _panel_values(history: pl.LazyFrame, panel: Panel) -> pl.DataFrame:
    """``sample_id``, ``value`` of one panel's series (recorded or derived)."""
    where = (pl.col("layer") == panel.layer) & (pl.col("tensor_path") == panel.tensor_path)
    if panel.metric == "l2_norm":
        frame = l2_norms(history, panel.signal).filter(where)
        return frame.select("sample_id", pl.col("norm").alias("value")).collect()
    if panel.metric == "update_to_weight":
        updates = l2_norms(history, "parameter_update").filter(where)
        weights = l2_norms(history, "parameter").filter(where)
        ratio = (pl.col("norm") / pl.col("weight_norm")).alias("value")
        return (
            updates.join(
                weights.rename({"norm": "weight_norm"}), on=["layer", "tensor_path", "sample_id"]
            )
            .select("sample_id", ratio)
            .collect()
        )
    return (
        history.filter(
            where
            & (pl.col("signal") == panel.signal)
            & (pl.col("metric") == panel.metric)
            & (pl.col("call_index") == 0)
        )
        .select("sample_id", "value")
        .collect()
    )


def run_series(
    run_dir: Path, panels: Sequence[Panel], losses: Sequence[float] | None = None
) -> pl.DataFrame:
    """One row per (sampled forward, panel) of one run; ``value`` is null where nothing was written.

    Every sampled forward appears, so a gradient that never arrived is a null row (a gap in the
    plot), never a zero. Panels read call 0 of their tensor path (``""``: the bare tensor
    output); a derived metric (``problems.DERIVED_METRICS``) is computed from the recorded ones;
    a :data:`~ti_examples.problems.LOSS` panel takes the training loop's ``losses`` (one per
    step) at each sampled step.
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
        if panel.signal == LOSS:
            if losses is None:
                raise ValueError(f"the panel {panel.label!r} needs the training loop's losses")
            steps = pl.DataFrame(
                {"forward_index": range(len(losses)), "value": list(losses)},
                schema={"forward_index": pl.Int64, "value": pl.Float64},
            )
            values = samples.join(steps, on="forward_index", how="left").select(
                "sample_id", "value"
            )
        else:
            values = _panel_values(history, panel)
        frames.append(
            samples.join(values, on="sample_id", how="left").with_columns(
                series=pl.lit(panel.label),
                layer=pl.lit(panel.layer),
                tensor_path=pl.lit(panel.tensor_path),
                signal=pl.lit(panel.signal),
                metric=pl.lit(panel.metric),
            )
        )
    return pl.concat(frames)


def comparison_frame(
    run_dirs: Mapping[Variant, Path],
    panels: Sequence[Panel],
    onset_step: int,
    losses: Mapping[Variant, Sequence[float]] | None = None,
) -> pl.DataFrame:
    """The evidence series of every variant, with ``after_onset`` marking faulty forwards
    (``losses``: each variant's loss per step, for a loss panel)."""
    frames = [
        run_series(path, panels, None if losses is None else losses[variant]).with_columns(
            variant=pl.lit(variant)
        )
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
