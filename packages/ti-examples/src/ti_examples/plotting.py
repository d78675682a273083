"""``comparison.png``: the evidence series of the three matched runs of one experiment."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from ti_examples.problems import VARIANTS, Panel

# Baseline is drawn wide and pale underneath, fixed dashed on top: where the two coincide
# (a fix that restores the baseline exactly) both stay visible.
STYLES: dict[str, dict[str, object]] = {
    "baseline": {"color": "#1f77b4", "marker": "o", "linewidth": 4.0, "alpha": 0.45},
    "broken": {"color": "#d62728", "marker": "s", "linewidth": 1.6, "alpha": 0.9},
    "fixed": {"color": "#2ca02c", "marker": "^", "linewidth": 1.6, "linestyle": "--"},
}


def plot_comparison(
    frame: pl.DataFrame,
    panels: Sequence[Panel],
    *,
    title: str,
    onset_sample: int,
    onset_step: int,
    sample_every: int,
    path: Path,
) -> Path:
    """Draw the comparison (see :func:`draw_comparison`) and save it as a PNG at ``path``."""
    fig = draw_comparison(
        frame,
        panels,
        title=title,
        onset_sample=onset_sample,
        onset_step=onset_step,
        sample_every=sample_every,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def draw_comparison(
    frame: pl.DataFrame,
    panels: Sequence[Panel],
    *,
    title: str,
    onset_sample: int,
    onset_step: int,
    sample_every: int,
) -> Figure:
    """One panel per evidence series, one line per variant.

    Missing values (no rows written, e.g. no gradient arrived) are NaN, so the line breaks
    instead of dropping to zero, and the panel title lists them. The fault onset is a dashed
    vertical line at the first faulty sample. A plain ``Figure`` (no pyplot state, any backend).
    """
    fig = Figure(figsize=(8, 3.2 * len(panels)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        gaps: list[str] = []
        for variant in VARIANTS:
            series = frame.filter(
                (pl.col("series") == panel.label) & (pl.col("variant") == variant)
            ).sort("sample_id")
            if series.is_empty():
                continue
            x = series["sample_id"].to_numpy()
            y = series["value"].cast(pl.Float64).fill_null(np.nan).to_numpy()
            ax.plot(x, y, label=variant, markersize=4, **STYLES[variant])
            missing = x[np.isnan(y)]
            if missing.size:
                gaps.append(f"{variant}: no value at samples {_ranges(missing)}")
        ax.axvline(
            onset_sample,
            color="black",
            linestyle="--",
            linewidth=1.2,
            label=f"fault onset (step {onset_step})",
        )
        if panel.log_scale:
            ax.set_yscale("log")
        where = f"{panel.layer}.{panel.tensor_path}" if panel.tensor_path else panel.layer
        heading = f"{where}: {panel.signal} {panel.metric}"
        if gaps:
            heading += "\n(gaps: " + "; ".join(gaps) + ")"
        ax.set_title(heading, fontsize=10)
        ax.set_ylabel(panel.metric + (" (log)" if panel.log_scale else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel(
        f"sample_id (one sampled forward every {sample_every} steps; gaps = no rows written)"
    )
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    return fig


def _ranges(values: np.ndarray) -> str:
    """``[4, 5, 6, 9]`` -> ``"4-6, 9"``."""
    ints = sorted(int(v) for v in values)
    parts = []
    start = prev = ints[0]
    for v in ints[1:]:
        if v != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = v
        prev = v
    parts.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(parts)
