"""index.md: what a run measured and how to query it, for a person or an LLM new to the project.

``render`` composes the page one section per function (status, events, run, files, how it was
measured, result.json and layers, unavailable values, queries); ``write_index`` publishes it.
Every text that comes from a run goes through :mod:`ti_io.finish.markdown` (JSON literals in
code blocks, escaped prose); the queries are :mod:`ti_io.finish.index_queries`'.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ti_io.damaged import DAMAGED_DIR, SKIPPED_FILE, gap_lines
from ti_io.facts import RunFacts, started_at_text
from ti_io.finish.index_queries import EVENTS_LISTED, event_queries, queries
from ti_io.finish.markdown import columns_table, fence, literal, md_escape
from ti_io.publishing import publish_text
from ti_io.storage import RunLocation
from ti_schema import (
    METRIC_DEFINITIONS,
    SCHEMA_VERSION,
    SIGNAL_DEFINITIONS,
    declared_metric,
    events_schema,
    histogram_schema,
    history_schema,
)


@dataclass(frozen=True)
class HistoryFacts:
    """Counts read from the history, for index.md."""

    rows: int = 0
    samples: int = 0
    first_sample: int | None = None
    last_sample: int | None = None
    first_time: datetime | None = None
    last_time: datetime | None = None
    layer_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    """layer -> (rows, unavailable rows)."""
    unavailable: list[tuple[str, str, str, str, int]] = field(default_factory=list)
    """(layer, signal, metric, reason, rows), most frequent first, truncated."""
    unavailable_total: int = 0
    histograms: int | None = None


def cost_line(facts: RunFacts) -> str:
    """``Telemetry cost: ...``: the run's measured cost (docs/capture.md, "Sampling"), or why it
    is unknown."""
    cost = facts.telemetry_cost
    if cost is None:
        return (
            "Telemetry cost: unknown (the run ended before its observer reported one: killed "
            "before a sampled forward a minute in, or written by an older producer)."
        )
    if cost.fraction is None:
        return f"Telemetry cost: {md_escape(cost.describe())}."
    return (
        f"Telemetry cost: {md_escape(cost.describe())}; measured on the training thread as "
        f"{md_escape(cost.method)} over {cost.measured_sampled_steps} sampled steps "
        '(docs/capture.md, "What telemetry cost the run").'
    )


def _layer_block(facts: RunFacts, data: HistoryFacts | None) -> list[str]:
    focus = set(facts.focus_layers)
    names = [info.name for info in facts.layers]
    extra = sorted(set(data.layer_rows) - set(names)) if data else []
    types = {info.name: info.module_type for info in facts.layers}
    aliases = {info.name: list(info.aliases) for info in facts.layers}
    rows = [("#", "layer", "type", "rows", "unavailable", "histograms", "aliases")]
    for i, name in enumerate([*names, *extra]):
        count, missing = data.layer_rows.get(name, (0, 0)) if data else (0, 0)
        rows.append(
            (
                str(i),
                literal(name),
                literal(types.get(name, "?")),
                str(count),
                str(missing),
                "yes" if name in focus else "no",
                json.dumps(aliases.get(name, [])),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return fence(
        ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    )


def _event_lines(index: int, event: Mapping[str, Any]) -> list[str]:
    first, count = int(event["dense_first_forward"]), int(event["dense_forwards"])
    head = f"#{index}  {event['kind']} at forward {event['forward_index']}"
    if event.get("signal") is not None:
        head += f"  signal {literal(str(event['signal']))}"
    lines = [f"{head}  rank {event['rank']}  at {event['timestamp']}"]
    if event.get("layer") is not None:
        lines.append(
            f"    first module: {literal(str(event['layer']))} "
            f"(type {literal(str(event.get('module_type') or ''))}, tensor path "
            f"{literal(str(event.get('tensor_path') or ''))})"
        )
        flagged = [literal(str(name)) for name in event.get("layers") or ()]
        lines.append(f"    flagged, in execution order: [{', '.join(flagged)}]")
    if event.get("reason") is not None:
        lines.append(f"    reason: {literal(str(event['reason']))}")
    if event.get("value") is not None:
        lines.append(f"    value: {event['value']!r}")
    if event.get("replay") is not None:
        because = event.get("replay_reason")
        lines.append(
            f"    replay: {literal(str(event['replay']))}"
            + (f" ({literal(str(because))})" if because else "")
        )
    dense = (
        f"forwards {first} .. {first + count - 1} ({count} root forwards, sampled in full)"
        if count > 0
        else "none (the run ended first)"
    )
    lines.append(f"    dense capture: {dense}")
    return lines


def _events_section(
    directory: Path | str, events: Sequence[Mapping[str, Any]] | None, *, live: bool
) -> list[str]:
    """The events, first thing after the status: what happened, where, and the queries for
    the dense samples each set off."""
    lines = ["## Events", ""]
    if live or events is None:
        return [
            *lines,
            "Events (a NaN or infinity first seen, a capture asked for, a loss spike) are "
            "published at once, one part each, in `events.parts/`; read them with "
            "`ti_io.read_events(DIR)`. Finalizing lists them here.",
            "",
        ]
    if not events:
        return [
            *lines,
            "None: no non-finite value was seen, no capture was asked for and no loss spike "
            "was reported (`events.parquet` is an empty table).",
            "",
        ]
    shown = events[:EVENTS_LISTED]
    more = len(events) - len(shown)
    lines += [
        f"{len(events)} event(s), in the order they happened (`events.parquet`, one row each; "
        "`ti.events` columns below). Each set off a dense capture: the root forwards from "
        "`dense_first_forward` on were all sampled; their history rows are those with "
        "`forward_index` in that range on the event's rank."
        + (
            f" The first {len(shown)} are listed; {more} more are in `events.parquet`."
            if more
            else ""
        ),
        "",
    ]
    block: list[str] = []
    for index, event in enumerate(shown):
        block += _event_lines(index, event)
    lines += fence(block)
    lines += ["Their dense samples (Python, Polars):", "", *event_queries(directory, events)]
    return lines


def render(
    directory: Path | str,
    facts: RunFacts,
    data: HistoryFacts | None,
    *,
    live: bool,
    events: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The text of index.md (``events``: :func:`ti_io.read.events.event_records` of the run,
    listed first; None for a live run)."""
    lines = [
        *_status(facts, live=live),
        *_events_section(directory, events, live=live),
        *_run_section(facts, data),
        *_files_section(),
        *_measurement_section(facts),
        *_result_json_section(facts, data),
        *_unavailable_section(data),
        "## Queries",
        "",
        "Ready to run (Python, Polars):",
        "",
        *queries(directory, facts, data.layer_rows if data is not None else {}),
    ]
    return "\n".join(lines)


def _status(facts: RunFacts, *, live: bool) -> list[str]:
    """What the directory is, whether the run is finished, its cost and any gap."""
    lines = [
        "# TorchInstruments run",
        "",
        "This directory holds per-layer statistics of a PyTorch model recorded by "
        "TorchInstruments: for every selected module, statistics of its **outputs** and of the "
        "**gradients with respect to those outputs** and, when they were asked for, of the "
        "**parameters** it owns, their **gradients** and their **updates**, sampled at some "
        "root forwards of the model. It measures; it does not judge (no score, ranking or "
        "diagnosis).",
        "",
    ]
    if live:
        lines += [
            "**Status: live or interrupted.** The run has not been finalized: completed chunks "
            "of history are in `history.parts/` (read them with `ti_io.scan_history(DIR)`), "
            "`result.json` lists the layers with empty `tensors`. Removing the observer "
            "finalizes the run; after a crash, `ti consolidate DIR` does.",
            "",
        ]
    else:
        lines += ["**Status: finalized.**", "", cost_line(facts), ""]
    if facts.skipped:
        headline, *entries = gap_lines(facts.skipped)
        lines += [
            f"**Gap: {md_escape(headline)}.** The history has a hole where their rows were; "
            f"every other row is there. The files kept in `{DAMAGED_DIR}/` are listed in "
            f"`{DAMAGED_DIR}/{SKIPPED_FILE}`:",
            "",
            *fence([literal(entry) for entry in entries]),
        ]
    return lines


def _run_section(facts: RunFacts, data: HistoryFacts | None) -> list[str]:
    """The run's facts (id, rank, producer, sampler, window, settings) and the history's."""
    window = facts.window
    facts_block = [
        f"run_id:        {literal(facts.run_id or 'unknown')}",
        f"rank:          {facts.rank} of world size {facts.world_size}",
        f"producer:      {literal(facts.producer or 'unknown')}",
        f"schema:        ti.history / ti.histograms / ti.events version {SCHEMA_VERSION}",
        f"started_at:    {literal(started_at_text(facts.started_at))}",
        f"sampler:       {literal(facts.sampler or 'unknown')}",
        f"window:        {window} samples (result.json window means)",
        f"layers:        {len(facts.layers)} selected, {len(facts.focus_layers)} with histograms",
        f"metrics:       {', '.join(literal(m) for m in facts.metrics)}",
    ]
    for key, value in sorted(facts.settings.items()):
        facts_block.append(f"setting:       {literal(key)} = {literal(value)}")
    if data is not None:
        span = "none"
        if data.first_time is not None and data.last_time is not None:
            seconds = (data.last_time - data.first_time).total_seconds()
            span = (
                f"{data.first_time.isoformat()} .. {data.last_time.isoformat()} ({seconds:.3f} s)"
            )
        facts_block += [
            f"samples:       {data.samples} (sample_id {data.first_sample} .. {data.last_sample})",
            f"time span:     {span}",
            f"history rows:  {data.rows} ({data.unavailable_total} unavailable)",
        ]
        if data.histograms is not None:
            facts_block.append(f"histograms:    {data.histograms} rows")
    return ["## Run", "", *fence(facts_block)]


def _files_section() -> list[str]:
    """The files of a run, and how names and checksums are handled."""
    return [
        "## Files",
        "",
        "- `history.parquet`: every scalar measurement, long format (one row per sample, "
        "layer, call, signal, tensor path and metric).",
        "- `histograms.parquet`: the histograms of the focus layers (enough to replay them "
        "without TensorBoard).",
        "- `result.json`: the history aggregated per layer, call, signal, tensor path and "
        "context (mode, grad_enabled).",
        "- `tensorboard/`: the same histograms as TensorBoard events, one tag per layer, call, "
        "signal and tensor path (`{layer}/call{call_index}/{signal}{tensor_path}`, a "
        "parameter's name joined with a dot, `fc/call0/parameter.weight`; unsafe "
        "characters percent-encoded, the root module as `%root`), step = `sample_id`.",
        "- `events.parquet`: the events of the run (`ti.events`, one row each; empty when there "
        "were none), listed above.",
        "- `history.parts/`, `histograms.parts/`, `events.parts/`: completed Parquet chunks "
        "while the run is live (an event is published at once, as a part of its own); removed "
        "once consolidated.",
        "",
        "Every Parquet file carries page checksums, which ti's readers verify. Polars and DuckDB "
        "do not verify them: run `ti validate DIR` before reading the files with them (it names "
        "every damaged file).",
        "",
        "Names of modules are arbitrary strings. In this file they appear only in code blocks, "
        "as JSON string literals (also valid Python literals).",
        "",
    ]


def _measurement_section(facts: RunFacts) -> list[str]:
    """Samples, signals, the columns of each table and the run's metrics."""
    lines = [
        "## How it was measured",
        "",
        "A *sample* is one sampled root forward of the model (`sample_id` counts them from 0); "
        "unsampled forwards are not measured. Each selected module call in a sampled forward "
        "is measured (`signal` = `output`), and so is the gradient with respect to that output "
        "when a backward reaches it (`signal` = `output_gradient`). Gradients are written when "
        "their backward ends, possibly out of order: **always order by `sample_id`**, never "
        "by row order or timestamp alone. A null `value` always has an `unavailable_reason`.",
        "",
        "Signals (values of the `signal` column; the run's `signals` setting above says which "
        "were recorded; the parameter signals have `tensor_path` = the parameter's name in the "
        "module, e.g. `weight`, and `call_index` 0):",
        "",
        "| signal | what was measured |",
        "|---|---|",
        *(
            f"| {md_escape(name)} | {md_escape(text)} |"
            for name, text in SIGNAL_DEFINITIONS.items()
        ),
        "",
        *columns_table("ti.history", history_schema()),
        "Histogram columns (`ti.histograms`) share the identity columns above and add:",
        "",
    ]
    identity = set(history_schema().names)
    hist_only = [f for f in histogram_schema() if f.name not in identity]
    lines += [
        "| column | Arrow type | meaning |",
        "|---|---|---|",
        *(
            f"| `{f.name}` | `{f.type}` | "
            f"{md_escape((f.metadata or {}).get(b'doc', b'').decode())} |"
            for f in hist_only
        ),
        "",
        *columns_table("ti.events", events_schema()),
        "Metrics (values of the `metric` column):",
        "",
        "| metric | definition |",
        "|---|---|",
    ]
    for metric in facts.metrics or tuple(METRIC_DEFINITIONS):
        spec = declared_metric(metric)
        definition = spec.definition if spec else "custom reducer (defined by the producer)"
        lines.append(f"| {md_escape(metric)} | {md_escape(definition)} |")
    return lines


def _result_json_section(facts: RunFacts, data: HistoryFacts | None) -> list[str]:
    """result.json's shape and aggregates, then the layers."""
    window = facts.window
    return [
        "",
        "## result.json",
        "",
        "A JSON array of layer records `{layer, type, aliases, tensors}`; every selected layer "
        "is listed, executed or not. Each tensor `{call_index, signal, tensor_path, mode, "
        "grad_enabled, latest_shape, dtype, statistics}`; `statistics` maps each metric to "
        "aggregates of its per-sample values (each sample weighs the same; not a pooled "
        "distribution of tensor entries): `observations` (samples with a value), "
        "`unavailable` (samples without), `mean`, `std` (population), `min`, `p25`, `p50`, "
        "`p75` (linear interpolation), `max`, `recent_window_mean` (mean of the last "
        f"{window} observations in sample order, or all of them when there are fewer), "
        f"`previous_window_mean` (mean of the up to {window} observations before those; null "
        "while there are none), and `unavailable_reason` (why an aggregate is null). "
        "For example `statistics.mean.p50` is the median of the sampled tensor means. "
        "Strict JSON: no NaN or Infinity.",
        "",
        "## Layers",
        "",
        "In traversal order; `histograms` marks the focus layers.",
        "",
        *_layer_block(facts, data),
    ]


def _unavailable_section(data: HistoryFacts | None) -> list[str]:
    """The most frequent groups of rows without a value."""
    lines: list[str] = []
    if data is not None and data.unavailable:
        lines += [
            "## Unavailable values",
            "",
            f"{data.unavailable_total} rows have no value; the most frequent groups:",
            "",
        ]
        block = ["rows  layer / signal / metric / reason"]
        for layer, signal, metric, reason, rows in data.unavailable:
            block.append(
                f"{rows:>4}  {literal(layer)} / {literal(signal)} / {literal(metric)} / "
                f"{literal(reason)}"
            )
        lines += fence(block)
    return lines


def write_index(
    directory: Path | RunLocation,
    facts: RunFacts,
    data: HistoryFacts | None,
    *,
    live: bool,
    events: Sequence[Mapping[str, Any]] | None = None,
    shown: str | None = None,
) -> None:
    """Publish index.md atomically (one object on an object store). ``shown``: the run's URI
    when ``directory`` is a local copy of a run on an object store (finalization stages there);
    the queries then read the URI."""
    if shown is None and isinstance(directory, RunLocation) and directory.local_path is None:
        shown = directory.uri
    where: Path | str
    if shown is not None:
        where = shown
    else:
        local = directory.local_path if isinstance(directory, RunLocation) else directory
        assert local is not None
        where = local.resolve()
    publish_text(directory / "index.md", render(where, facts, data, live=live, events=events))
