"""``ti compare --plot``: the aligned series of compared runs as a PNG (needs matplotlib).

matplotlib is not a dependency of ti-io (reading runs should stay light); it is the optional
extra ``plot``: ``pip install "ti-io[plot]"``. Importing this module without it raises an
ImportError that says so.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Final

import numpy as np
import polars as pl

try:
    from matplotlib.figure import Figure
except ImportError as _import_error:
    raise ImportError(
        "Please install `matplotlib` to plot comparisons (ti compare --plot, ti_io.read.plot), "
        'you can use the `plot` optional group — `pip install "ti-io[plot]"`'
    ) from _import_error

from ti_io.read.compare import KEY

MAX_PANELS: Final[int] = 16
"""One panel per measurement: more would not be readable; narrow the comparison instead."""

# The first run (the reference) is drawn wide and pale underneath, so a run that coincides with
# it stays visible on top.
REFERENCE_STYLE: Final[dict[str, object]] = {"linewidth": 4.0, "alpha": 0.45, "marker": "o"}
OTHER_STYLE: Final[dict[str, object]] = {"linewidth": 1.6, "alpha": 0.9, "marker": "s"}


def plot_series(
    series: pl.DataFrame,
    path: str | os.PathLike[str],
    *,
    onset: int | None = None,
    title: str | None = None,
) -> Path:
    """Draw a :func:`ti_io.compare_series` frame and save it as a PNG at ``path``.

    One panel per measurement, one line per run; a missing value is a gap in the line (never
    a zero) and the panel title lists where; ``onset`` draws a dashed vertical line at that
    sample. A panel whose values are all positive and span more than three orders of
    magnitude gets a log scale. Raises ``ValueError`` for an empty frame or more than
    :data:`MAX_PANELS` measurements.
    """
    keys = series.select(KEY).unique(maintain_order=True)
    if keys.height == 0:
        raise ValueError("nothing to plot: the comparison holds no measurement")
    if keys.height > MAX_PANELS:
        raise ValueError(
            f"--plot draws one panel per measurement, and {keys.height} match; narrow them to "
            f"at most {MAX_PANELS} with --layer, --signal and --metric"
        )
    runs = series.get_column("run").unique(maintain_order=True).to_list()
    fig = Figure(figsize=(8, 3.0 * keys.height + 0.6))
    axes = fig.subplots(keys.height, 1, sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys.iter_rows(named=True), strict=True):
        panel = series.filter(*(pl.col(name) == value for name, value in key.items()))
        gaps: list[str] = []
        for i, run in enumerate(runs):
            line = panel.filter(pl.col("run") == run).sort("sample_id")
            if line.is_empty():
                continue
            x = line.get_column("sample_id").to_numpy()
            y = line.get_column("value").cast(pl.Float64).fill_null(np.nan).to_numpy()
            style = REFERENCE_STYLE if i == 0 else OTHER_STYLE
            ax.plot(x, y, label=run, markersize=4, **style)
            missing = x[np.isnan(y)]
            if missing.size:
                gaps.append(f"{run}: no value at samples {_ranges(missing)}")
        if onset is not None:
            ax.axvline(onset, color="black", linestyle="--", linewidth=1.2, label=f"onset {onset}")
        values = panel.get_column("value").drop_nulls().to_numpy()
        values = values[np.isfinite(values)]
        if values.size and values.min() > 0 and values.max() / values.min() > 1e3:
            ax.set_yscale("log")
        heading = _heading(key)
        if gaps:
            heading += "\n(gaps: " + "; ".join(gaps) + ")"
        ax.set_title(heading, fontsize=9)
        ax.set_ylabel(str(key["metric"]))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("sample_id (shared samples of the compared runs; gaps = no value)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100, format="png")
    return target


def _heading(key: dict[str, object]) -> str:
    layer = str(key["layer"]) or "(root)"
    where = f"{layer} call {key['call_index']}" if key["call_index"] else layer
    path = f" {key['tensor_path']}" if key["tensor_path"] else ""
    context = "" if key["mode"] == "train" and key["grad_enabled"] else f" [{key['mode']}]"
    return f"{where}{path}: {key['signal']} {key['metric']}{context}"


def _ranges(values: np.ndarray) -> str:
    """``[4, 5, 6, 9]`` -> ``"4-6, 9"``."""
    ints = sorted(int(v) for v in values if not math.isnan(v))
    parts = []
    start = prev = ints[0]
    for v in ints[1:]:
        if v != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = v
        prev = v
    parts.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(parts)
