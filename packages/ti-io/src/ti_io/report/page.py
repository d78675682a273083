"""``write_report``: one self-contained HTML page of one or more runs.

The page inlines plotly.js and its own style, so it opens from disk with no network. What
comes from a run (layer, module and run names, reasons, settings, paths) is escaped wherever it
lands: in our markup (``html.escape``), in Plotly's labels (:func:`~ti_io.report.figures.plain`)
and in Plotly's JSON (which escapes ``<``, ``>`` and ``/``). The file is written beside its
destination and renamed into place, so a failure leaves no partial page.
"""

from __future__ import annotations

import datetime as _dt
import glob
import html
import itertools
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl

from ti_io.damaged import gap_lines
from ti_io.facts import (
    RunFacts,
    read_run_facts,
    recorded_run_lines,
    recorded_settings,
)
from ti_io.progress import ProgressCallback
from ti_io.read.compare import ComparedRun, compare_runs, open_runs
from ti_io.read.events import describe_event, event_records, read_events
from ti_io.read.filters import matching_layers, names, signal_names
from ti_io.read.history import history_files_of
from ti_io.report import figures
from ti_io.report.grid import Panel, RunGrid, read_grid
from ti_schema import PRECISION_METRICS, SIGNALS, declared_metric

DEFAULT_PANELS: Final[tuple[Panel, ...]] = (("output", "std"), ("output_gradient", "std"))
"""Drawn by default, where the runs hold them."""
HEALTH_METRICS: Final[tuple[str, ...]] = ("nonfinite_fraction",)
"""Drawn by default for every signal where any value is not 0 (precision metrics too)."""
DEFAULT_COLUMNS: Final[int] = 400
"""Columns of samples per heat map, at most (each a min/max envelope and a mean)."""
CELL_BUDGET: Final[int] = 200_000
"""Heat-map cells of the whole page, at most (what keeps a report of a long, wide run under
10 MB): fewer columns are drawn when layers x runs x panels would exceed it."""
SPARK_POINTS: Final[int] = 32

RunArgument = str | os.PathLike[str]


@dataclass(frozen=True)
class _Recorded:
    """What the page reads of a run besides its rows, read once: its facts (run.json while
    live) and index.md's run block (what a finalized run keeps of them)."""

    facts: RunFacts
    lines: dict[str, str]

    @classmethod
    def of(cls, directory: Path) -> _Recorded:
        return cls(read_run_facts(directory), recorded_run_lines(directory))

    @property
    def metrics(self) -> tuple[str, ...]:
        """The run's metric profile."""
        line = self.lines.get("metrics", "")
        return self.facts.metrics or tuple(name for name in line.split(", ") if name)

    @property
    def catalog(self) -> list[str]:
        """The selected layers' names, in model order."""
        return [info.name for info in self.facts.layers]


@dataclass(frozen=True)
class _Run:
    opened: ComparedRun
    location: str
    recorded: _Recorded
    grid: RunGrid
    events: list[dict[str, Any]]


def _selected_panels(
    held: set[str], signals: list[str] | None, metrics: list[str] | None
) -> tuple[list[Panel], list[Panel]]:
    """The panels asked for (drawn where held) and the health panels (drawn where not all 0);
    ``held``: the metrics the runs record."""
    if metrics is not None:
        unknown = [m for m in metrics if m not in held and declared_metric(m) is None]
        if unknown:
            known = ", ".join(sorted(held)) or "none recorded"
            raise ValueError(
                f"--metric {', '.join(map(repr, unknown))}: no run records such a metric "
                f"(they record: {known})"
            )
    chosen_signals = signals or [s for s, _ in DEFAULT_PANELS]
    if metrics is not None:
        asked = [(s, m) for s in chosen_signals for m in metrics]
    else:
        asked = [p for p in DEFAULT_PANELS if p[0] in chosen_signals] or [
            (s, "std") for s in chosen_signals
        ]
    precision = sorted(m for m in held if m.partition(".")[0] in PRECISION_METRICS)
    health = [
        (s, m)
        for s in (signals or SIGNALS)
        for m in (*HEALTH_METRICS, *precision)
        if (s, m) not in asked
    ]
    return asked, health


def write_report(
    runs: RunArgument | Sequence[RunArgument] | Mapping[str, RunArgument],
    path: str | os.PathLike[str],
    *,
    signals: str | Sequence[str] | None = None,
    metrics: str | Sequence[str] | None = None,
    layers: str | Sequence[str] | None = None,
    columns: int = DEFAULT_COLUMNS,
    progress: ProgressCallback | None = None,
    locations: Sequence[str] | None = None,
) -> Path:
    """Write the report of ``runs`` (one run directory, several, or ``{label: directory}``;
    live or finalized) to ``path`` and return it.

    One heat map per signal and metric (default: ``output`` and ``output_gradient`` ``std``,
    and ``nonfinite_fraction`` and the precision metrics of any signal where a value is not
    0): layers as rows in model order, samples as columns (at most ``columns``, each the mean
    of the samples it covers, its min/max on hover), the runs side by side on one colour
    scale (log where values >= 0 span more than 20x), the events as marks; per layer,
    a sparkline with the latest value and result.json's window means; with several runs, each
    tensor's recent window mean over the first run's (``ti compare``'s ``recent_ratio``).
    ``layers``: globs. ``locations``: what the page names as each run's location (default:
    its directory; ``ti report`` passes a URI it read through a local copy). Memory is
    bounded by the page, not by the runs' length.

    Raises what :func:`ti_io.compare_runs` raises for a path that is not a run, a run of
    another contract major or a torchinstruments 0.8.0 run, ``ValueError`` for an unknown
    metric, a glob that matches no layer or a selection no run holds, ``ImportError`` naming
    the ``report`` extra without plotly. Nothing is written unless the whole page is.
    """
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
        raise ValueError(f"columns must be an int >= 1, got {columns!r}")
    chosen_signals = signal_names(signals)
    chosen_metrics = names(metrics, "metric")
    patterns = names(layers, "layers")
    given: Sequence[RunArgument] | Mapping[str, RunArgument] = (
        [runs] if isinstance(runs, str | os.PathLike) else runs
    )
    opened = open_runs(given, minimum=1)
    if not any(run.samples for run in opened):
        empty = ", ".join(run.label for run in opened)
        raise ValueError(f"{empty}: no sample yet (a live run that has published no part)")
    recorded = [_Recorded.of(run.directory) for run in opened]
    held = {metric for run in recorded for metric in run.metrics}
    asked, health = _selected_panels(held, chosen_signals, chosen_metrics)
    catalogs = [run.catalog for run in recorded]
    kept: list[str] = []
    if patterns is not None:
        every = list(dict.fromkeys(name for catalog in catalogs for name in catalog))
        kept = matching_layers(every, patterns)
        if not kept:
            raise ValueError(
                f"--layer {' '.join(map(repr, patterns))} matches no layer of the runs; they "
                f"hold {', '.join(repr(n) for n in every[:8])}{', ...' if len(every) > 8 else ''}"
            )
    tensors = max(1, max(len(kept or catalog) for catalog in catalogs))
    width = max(16, min(columns, CELL_BUDGET // (tensors * len(opened) * (len(asked) + 1))))
    width = min(width, columns)
    loaded: list[_Run] = []
    shown = list(locations) if locations is not None else [str(r.directory) for r in opened]
    if len(shown) != len(opened):
        raise ValueError(f"locations names {len(shown)} runs, not {len(opened)}")
    for run, known, location in zip(opened, recorded, shown, strict=True):
        grid = read_grid(
            history_files_of(run.directory),
            run.samples,
            [*asked, *health],
            columns=width,
            window=known.facts.window,
            layers=kept,
            order=known.catalog,
            progress=progress,
        )
        loaded.append(_Run(run, location, known, grid, event_records(read_events(run.directory))))
    drawn = [p for p in asked if any(p in r.grid.panels for r in loaded)]
    drawn += [
        p for p in health if any(p in r.grid.panels and r.grid.panels[p].nonzero for r in loaded)
    ]
    if not drawn:
        wanted = ", ".join(f"{s} {m}" for s, m in asked)
        raise ValueError(f"no run holds {wanted}; choose others with --signal and --metric")
    ratios = _ratios(opened, drawn, kept) if len(opened) > 1 else None
    page = _page(loaded, drawn, ratios)
    return _write_atomically(Path(path), page)


def _ratios(
    opened: Sequence[ComparedRun], panels: Sequence[Panel], layers: Sequence[str]
) -> pl.DataFrame | str:
    """``compare_runs``' table of the drawn panels, or why there is none (runs that share no
    sample or no layer have no ratio)."""
    runs = {run.label: run.directory for run in opened}
    try:
        return compare_runs(
            runs,
            signal=sorted({s for s, _ in panels}),
            metric=sorted({m for _, m in panels}),
            layer=[glob.escape(name) for name in layers] or None,  # names, not patterns
        )
    except ValueError as exc:
        return str(exc)


def _write_atomically(path: Path, text: str) -> Path:
    """``text`` at ``path``, whole or not at all: written to a new private file beside it
    (``mkstemp``: never a file or link already there), then renamed over it."""
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    temporary = Path(name)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


# --- the page -----------------------------------------------------------------------------------

_STYLE: Final[str] = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #1f2328; }
h1 { font-size: 1.5em; } h2 { font-size: 1.25em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #d0d7de; padding: 2px 6px; text-align: left; vertical-align: middle; }
th { background: #f6f8fa; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #59636e; font-size: 0.9em; } .bad { color: #b42318; }
svg.spark { display: block; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _number(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and not np.isfinite(value):
        return f"<span class='bad'>{_e(value)}</span>"  # a NaN or infinity shows as one
    return _e(f"{value:.4g}") if isinstance(value, float) else _e(value)


def _facts(run: _Run) -> dict[str, str]:
    """What the page's run table says of ``run``: its header (contract, sampler, ranks, what
    was selected, the telemetry cost), its settings, and any gap a consolidation left."""
    facts, lines, opened = run.recorded.facts, run.recorded.lines, run.opened
    samples = run.grid.samples
    ranks = lines.get("rank", "unknown")
    if facts.world_size is not None:
        ranks = f"{facts.rank} of world size {facts.world_size}"
    cost = facts.telemetry_cost
    rows = {
        "location": run.location,
        "status": "finalized" if opened.finalized else "live or unconsolidated (history.parts)",
        "contract": opened.contract_version or "unknown",
        "producer": facts.producer or lines.get("producer", "unknown"),
        "started": facts.started_at or lines.get("started_at", "unknown"),
        "sampler": facts.sampler or lines.get("sampler", "unknown"),
        "rank": ranks,
        "samples": f"{samples.size} ({samples[0]}..{samples[-1]})" if samples.size else "none yet",
        "selected": f"{len(facts.layers)} layers" if facts.layers else "unknown (no catalog)",
        "metrics": ", ".join(run.recorded.metrics) or "unknown",
        "window": f"{facts.window} samples",
        "telemetry cost": cost.describe() if cost is not None else "unknown (not reported)",
    }
    if facts.focus_layers:
        rows["focus layers"] = ", ".join(facts.focus_layers)
    rows |= {f"setting {k}": v for k, v in recorded_settings(opened.directory).items()}
    rows |= {f"GAP {i + 1}": line for i, line in enumerate(gap_lines(facts.skipped))}
    return rows


def _at_a_glance(loaded: Sequence[_Run]) -> str:
    """One line per run above the plots: what it is and how much it holds (details at the
    end of the page)."""
    items = []
    for run in loaded:
        samples = run.grid.samples
        held = f"{samples.size} samples" if samples.size else "no samples yet"
        state = "finalized" if run.opened.finalized else "live"
        items.append(
            f"<li><strong>{_e(run.opened.label)}</strong>: {_e(state)}, {_e(held)}, "
            f"{len(run.events)} event(s); {_e(run.location)}</li>"
        )
    return f"<ul class='glance'>{''.join(items)}</ul>"


def _runs_table(loaded: Sequence[_Run]) -> str:
    """One row per fact, one column per run."""
    described = [_facts(run) for run in loaded]
    keys = list(dict.fromkeys(key for facts in described for key in facts))
    head = "<tr><th></th>" + "".join(f"<th>{_e(run.opened.label)}</th>" for run in loaded)
    body = "".join(
        f"<tr><th>{_e(key)}</th>"
        + "".join(f"<td>{_e(facts.get(key, ''))}</td>" for facts in described)
        + "</tr>"
        for key in keys
    )
    return f"<table class='runs'>{head}</tr>{body}</table>"


def _event_marks(run: _Run) -> list[tuple[int, str]]:
    marks = []
    for event in run.events:
        sample = run.grid.sample_at_forward(int(event["forward_index"]))
        if sample is None:
            continue
        verdict = event.get("replay")
        marks.append((sample, f"{event['kind']}{' ' + verdict if verdict else ''}"))
    return marks


def _events(loaded: Sequence[_Run]) -> str:
    rows = [
        f"<tr><td>{_e(run.opened.label)}</td><td>{_e(describe_event(event))}</td></tr>"
        for run in loaded
        for event in run.events
    ]
    if not rows:
        return "<p class='note'>No events (flight recorder, manual or loss) in these runs.</p>"
    head = "<tr><th>run</th><th>event</th></tr>"
    return f"<table class='events'>{head}{''.join(rows)}</table>"


def _spark(values: npt.NDArray[np.float64]) -> str:
    """A sparkline of ``values`` (NaN: a gap) as an inline SVG path: numbers only."""
    if values.size > SPARK_POINTS:
        edges = np.linspace(0, values.size, SPARK_POINTS + 1).astype(int)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN stretch: a gap
            values = np.array([np.nanmean(values[a:b]) for a, b in itertools.pairwise(edges)])
    finite = values[np.isfinite(values)]
    if not finite.size:
        return ""
    low, high = float(finite.min()), float(finite.max())
    scale = (high - low) or 1.0
    step = 120.0 / max(values.size - 1, 1)
    path, pen = [], "M"
    for i, value in enumerate(values):
        if not np.isfinite(value):
            pen = "M"
            continue
        path.append(f"{pen}{i * step:.0f},{22 - 20 * (value - low) / scale:.1f}")
        pen = "L"
    return (
        "<svg class='spark' width='120' height='24' viewBox='0 0 120 24'>"
        f"<path d='{' '.join(path)}' fill='none' stroke='#0969da' stroke-width='1.3'/></svg>"
    )


def _layer_table(panel: Panel, loaded: Sequence[_Run]) -> str:
    grids = [run.grid.panels.get(panel) for run in loaded]
    rows = figures.panel_rows(grids)
    head = "<tr><th>tensor</th>" + "".join(
        f"<th colspan='4'>{_e(run.opened.label)}</th>" for run in loaded
    )
    head += "</tr><tr><th></th>" + (
        "<th>trend</th><th>latest</th><th>recent mean</th><th>previous mean</th>" * len(loaded)
    )
    body = []
    for i, label in enumerate(rows.labels):
        cells = [f"<td>{_e(label)}</td>"]
        for run, grid, at in zip(loaded, grids, rows.positions, strict=True):
            samples = run.grid.samples
            run_last = int(samples[-1]) if samples.size else None
            if grid is None or at[i] < 0:
                cells.append("<td colspan='4' class='note'>not in this run</td>")
                continue
            stats = grid.tensors.row(int(at[i]), named=True)
            cells.append(f"<td>{_spark(grid.mean[at[i]])}</td>")
            latest = _number(stats["latest"])
            if stats["latest_sample"] != run_last:  # it stopped before the run did
                latest += f" <span class='note'>(sample {_e(stats['latest_sample'])})</span>"
            cells.append(f"<td class='n'>{latest}</td>")
            cells += [
                f"<td class='n'>{_number(stats[k])}</td>"
                for k in ("recent_window_mean", "previous_window_mean")
            ]
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table class='layers'>{head}</tr>{''.join(body)}</table>"


def _page(
    loaded: Sequence[_Run], panels: Sequence[Panel], ratios: pl.DataFrame | str | None
) -> str:
    labels = [run.opened.label for run in loaded]
    runs = [(run.opened.label, run.grid) for run in loaded]
    marks = [_event_marks(run) for run in loaded]
    sections = [_at_a_glance(loaded), "<h2>Events</h2>" + _events(loaded)]
    for k, panel in enumerate(panels):
        figure = figures.panel_figure(panel, runs, marks)
        sections.append(
            f"<h2>{_e(panel[0])} {_e(panel[1])}</h2>"
            + figures.figure_html(figure, f"panel-{k}")
            + "<details open><summary>per layer</summary>"
            + _layer_table(panel, loaded)
            + "</details>"
        )
    if isinstance(ratios, pl.DataFrame):
        figure = figures.ratio_figure(ratios, panels, labels[0])
        sections.append("<h2>Against the first run</h2>" + figures.figure_html(figure, "ratios"))
    elif isinstance(ratios, str):
        sections.append(f"<h2>Against the first run</h2><p class='note'>{_e(ratios)}</p>")
    sections.append("<h2>Runs</h2>" + _runs_table(loaded))
    title = "TorchInstruments report: " + ", ".join(labels)
    made = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{_STYLE}</style>"
        f"<script type='text/javascript'>{figures.plotly_js()}</script></head><body>"
        f"<h1>{_e(title)}</h1><p class='note'>Written {made} by ti report. Heat maps: one row "
        "per layer in model order, one column per run of samples (its mean; hover for its min "
        "and max).</p>" + "".join(sections) + "</body></html>\n"
    )
