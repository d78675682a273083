"""The report's figures, drawn with Plotly (the optional extra ``report``).

A panel of one or more runs is one figure: a heat map per run, side by side on one colour
scale, with layers as rows (in the run's order) and columns of samples as columns; events are
vertical marks. The ratio view is a heat map of each tensor's recent window mean over the
first run's, per run, on a diverging log scale centred on 1. Every text that comes from a run
goes through :func:`plain`: Plotly renders a few HTML tags inside labels, and a run's names are
data, never markup.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl

try:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
except ImportError as _import_error:
    raise ImportError(
        "Please install `plotly` to draw reports (ti report, ti_io.write_report), "
        'you can use the `report` optional group — `pip install "ti-io[report]"`'
    ) from _import_error

from ti_io.read.ordering import TENSOR_KEYS
from ti_io.read.summary import display_name
from ti_io.report.grid import Panel, PanelGrid, RunGrid

LOG_SPAN: Final[float] = 20.0
"""A panel whose values are >= 0 and span more than this factor (over a decade: layers' scales
differ that much, and a linear scale would show only the largest) is coloured on a log
scale."""
ROW_PX: Final[int] = 14
MAX_HEIGHT_PX: Final[int] = 2400


def plain(text: str) -> str:
    """``text`` shown as itself in a Plotly label (its HTML-like tags are not rendered)."""
    return html.escape(text, quote=False)


def tensor_labels(keys: Sequence[dict[str, Any]]) -> list[str]:
    """Each tensor's row label: its layer as ``ti summary`` shows it (``(root)`` for the root,
    control characters escaped), with the call, tensor path and context where the tensors
    differ in them."""
    varying = {
        name for name in ("call_index", "mode", "grad_enabled") if len({k[name] for k in keys}) > 1
    }
    return [_label(key, varying) for key in keys]


def _label(key: dict[str, Any], varying: set[str]) -> str:
    parts = [display_name(str(key["layer"]))]
    if "call_index" in varying:
        parts.append(f"call {key['call_index']}")
    if key["tensor_path"]:
        parts.append(f"[{key['tensor_path']}]")
    if "mode" in varying or "grad_enabled" in varying:
        parts.append(f"({key['mode']}{'' if key['grad_enabled'] else ', no grad'})")
    return " ".join(parts)


@dataclass(frozen=True)
class Rows:
    """The rows of one panel across runs: every tensor any run holds, in the first holder's
    order, with each run's row of it (-1: the run lacks it)."""

    labels: list[str]
    positions: list[npt.NDArray[np.int64]]


def panel_rows(grids: Sequence[PanelGrid | None]) -> Rows:
    """The union of the tensors of ``grids`` (one per run; None: the run lacks the panel)."""
    keys: dict[tuple[Any, ...], int] = {}
    found: list[dict[str, Any]] = []
    for grid in grids:
        if grid is None:
            continue
        for row in grid.tensors.select(TENSOR_KEYS).iter_rows(named=True):
            key = tuple(row.values())
            if key not in keys:
                keys[key] = len(found)
                found.append(row)
    positions = []
    for grid in grids:
        at = np.full(len(found), -1, dtype=np.int64)
        if grid is not None:
            for i, values in enumerate(grid.tensors.select(TENSOR_KEYS).iter_rows()):
                at[keys[tuple(values)]] = i
        positions.append(at)
    return Rows(tensor_labels(found), positions)


def _reindexed(values: npt.NDArray[np.float64], at: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    out = np.full((at.size, values.shape[1] if values.ndim == 2 else 1), np.nan)
    held = at >= 0
    out[held] = values[at[held]]
    return out


@dataclass(frozen=True)
class ColourScale:
    """One colour scale for every run of a panel: linear, or log10 of values clamped to the
    smallest positive one (a zero shows as the bottom of the scale, its hover the real value)."""

    log: bool
    low: float
    high: float
    floor: float

    @classmethod
    def of(cls, arrays: Sequence[npt.NDArray[np.float64]]) -> ColourScale:
        finite = np.concatenate([a[np.isfinite(a)] for a in arrays] or [np.empty(0)])
        if not finite.size:
            return cls(False, 0.0, 1.0, 0.0)
        positive = finite[finite > 0]
        low, high = float(finite.min()), float(finite.max())
        if low >= 0 and positive.size and high / float(positive.min()) > LOG_SPAN:
            floor = float(positive.min())
            return cls(True, math.log10(floor), math.log10(high), floor)
        return cls(False, low, high if high > low else low + 1.0, 0.0)

    def colour(self, values: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
        if not self.log:
            return values.astype(np.float32)
        with np.errstate(invalid="ignore"):
            return np.log10(np.maximum(values, self.floor)).astype(np.float32)

    def colorbar(self, title: str) -> dict[str, Any]:
        bar: dict[str, Any] = {"title": {"text": plain(title)}}
        if self.log:
            decades = list(range(math.floor(self.low), math.ceil(self.high) + 1))
            bar |= {"tickvals": decades, "ticktext": [f"1e{d}" for d in decades]}
        return bar


def _height(rows: int) -> int:
    return int(min(MAX_HEIGHT_PX, max(320, 140 + ROW_PX * rows)))


def panel_figure(
    panel: Panel,
    runs: Sequence[tuple[str, RunGrid]],
    events: Sequence[Sequence[tuple[int, str]]],
) -> go.Figure:
    """The heat maps of ``panel`` for every run (``(label, grid)``), side by side on one colour
    scale; ``events``: per run, ``(sample id, text)`` marks."""
    signal, metric = panel
    grids = [grid.panels.get(panel) for _, grid in runs]
    rows = panel_rows(grids)
    means = [
        _reindexed(g.mean, at) if g is not None else np.full((len(rows.labels), 1), np.nan)
        for g, at in zip(grids, rows.positions, strict=True)
    ]
    scale = ColourScale.of(means)
    figure = make_subplots(
        rows=1,
        cols=len(runs),
        shared_yaxes=True,
        horizontal_spacing=0.02,
        subplot_titles=[plain(label) for label, _ in runs],
    )
    y = [plain(label) for label in rows.labels]
    for col, ((_, grid), g, at, mean) in enumerate(
        zip(runs, grids, rows.positions, means, strict=True), start=1
    ):
        if g is None:
            continue
        low, high = _reindexed(g.low, at), _reindexed(g.high, at)
        figure.add_trace(
            go.Heatmap(
                z=scale.colour(mean),
                x=grid.column_edges,  # edges: a column spans its samples exactly
                y=y,
                customdata=np.stack([mean, low, high], axis=-1).astype(np.float32),
                coloraxis="coloraxis",
                hovertemplate=(
                    "%{y}<br>around sample %{x:.0f}<br>mean %{customdata[0]:.4g}"
                    "<br>min %{customdata[1]:.4g}, max %{customdata[2]:.4g}<extra></extra>"
                ),
                hoverongaps=False,
            ),
            row=1,
            col=col,
        )
        for sample, text in events[col - 1]:
            figure.add_vline(
                x=sample, line={"color": "#d62728", "width": 2, "dash": "dot"}, row=1, col=col
            )
            figure.add_annotation(
                x=sample,
                y=1.0,
                yref="paper",
                xref=f"x{col if col > 1 else ''}",
                text=plain(text),
                showarrow=False,
                yanchor="bottom",
                font={"color": "#d62728", "size": 11},
            )
    figure.update_layout(
        title={"text": plain(f"{signal} {metric}") + (" (log colour scale)" if scale.log else "")},
        coloraxis={
            "colorscale": "Viridis",
            "cmin": scale.low,
            "cmax": scale.high,
            "colorbar": scale.colorbar(metric),
        },
        height=_height(len(rows.labels)),
        margin={"l": 10, "r": 10, "t": 90, "b": 40},
    )
    figure.update_yaxes(autorange="reversed", type="category", row=1, col=1)
    figure.update_xaxes(title={"text": "sample id"})
    return figure


def ratio_figure(table: pl.DataFrame, panels: Sequence[Panel], reference: str) -> go.Figure:
    """Each tensor's recent window mean over the first run's (a :func:`ti_io.compare_runs`
    table's ``recent_ratio``), one heat map per panel, runs as columns, log2 colours centred on
    1 (red: larger than ``reference``)."""
    figure = make_subplots(
        rows=1,
        cols=len(panels),
        horizontal_spacing=0.12,
        subplot_titles=[plain(f"{s} {m}") for s, m in panels],
    )
    bound = 1.0
    traces = []
    for signal, metric in panels:
        part = table.filter(
            (pl.col("signal") == signal)
            & (pl.col("metric") == metric)
            & (pl.col("run") != reference)
        )
        keys = part.select(TENSOR_KEYS).unique(maintain_order=True)
        labels = tensor_labels(list(keys.iter_rows(named=True)))
        runs = part.get_column("run").unique(maintain_order=True).to_list()
        ratio = np.full((len(labels), len(runs)), np.nan)
        index = {tuple(k): i for i, k in enumerate(keys.iter_rows())}
        for row in part.select(*TENSOR_KEYS, "run", "recent_ratio").iter_rows():
            value = row[-1]
            if value is not None and value > 0:
                ratio[index[tuple(row[: len(TENSOR_KEYS)])], runs.index(row[-2])] = value
        with np.errstate(divide="ignore", invalid="ignore"):
            log = np.log2(ratio)
        finite = log[np.isfinite(log)]
        if finite.size:
            bound = max(bound, float(np.abs(finite).max()))
        traces.append((labels, runs, log, ratio))
    for col, (labels, runs, log, ratio) in enumerate(traces, start=1):
        figure.add_trace(
            go.Heatmap(
                z=log.astype(np.float32),
                x=[plain(run) for run in runs],
                y=[plain(label) for label in labels],
                customdata=ratio.astype(np.float32),
                coloraxis="coloraxis",
                hovertemplate="%{y}<br>%{x}: %{customdata:.4g}x<extra></extra>",
                hoverongaps=False,
            ),
            row=1,
            col=col,
        )
        figure.update_yaxes(autorange="reversed", type="category", row=1, col=col)
    top = math.ceil(bound)
    stride = max(1, math.ceil(top / 4))  # at most 9 ticks
    reach = math.ceil(top / stride)
    decades = [i * stride for i in range(-reach, reach + 1)]
    figure.update_layout(
        title={"text": plain(f"recent window mean, ratio to {reference}")},
        coloraxis={
            "colorscale": "RdBu_r",
            "cmid": 0.0,
            "cmin": -bound,
            "cmax": bound,
            "colorbar": {
                "title": {"text": "ratio"},
                "tickvals": decades,
                "ticktext": [f"{2.0**d:g}x" for d in decades],
            },
        },
        height=_height(max((len(t[0]) for t in traces), default=1)),
        margin={"l": 10, "r": 10, "t": 90, "b": 40},
    )
    return figure


def figure_html(figure: go.Figure, div_id: str) -> str:
    """``figure`` as a ``<div>`` and its ``<script>`` (Plotly's own JSON, in which ``<``, ``>``
    and ``/`` are escaped); plotly.js itself is inlined once by the page."""
    return str(
        figure.to_html(
            include_plotlyjs=False,
            full_html=False,
            div_id=div_id,
            config={"displaylogo": False, "responsive": True},
        )
    )


def plotly_js() -> str:
    """plotly.js, as shipped inside the installed plotly package (nothing is fetched)."""
    from plotly.offline import get_plotlyjs

    return str(get_plotlyjs())
