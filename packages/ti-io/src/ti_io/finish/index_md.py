"""index.md: what a run measured and how to query it, for a person or an LLM new to the project.

Module names are arbitrary strings (``/``, ``..``, newlines, Markdown, HTML). They never appear
in Markdown prose: only inside fenced code blocks, and there as JSON string literals with
non-ASCII and ``<>&`` escaped (:func:`literal`), which are also valid Python literals. A
literal never contains a newline or starts a line, so it cannot close a fence or inject
markup. Other variable text in prose goes through :func:`md_escape`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from ti_io.damaged import DAMAGED_DIR, SKIPPED_FILE, gap_lines
from ti_io.facts import RunFacts, started_at_text
from ti_io.publishing import publish_text
from ti_io.storage import RunLocation
from ti_schema import (
    METRIC_DEFINITIONS,
    PRECISION_FORMATS,
    SCHEMA_VERSION,
    SIGNAL_DEFINITIONS,
    declared_metric,
    events_schema,
    histogram_schema,
    history_schema,
)

_MD_SPECIAL: Final[re.Pattern[str]] = re.compile(
    r"([\\`*\[\]<>|~&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))"
)


def md_escape(text: str) -> str:
    """``text`` safe inside a Markdown table cell: one line; characters that could start
    markup there (code, emphasis, links, HTML, entities, cell breaks) backslash-escaped."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(text.splitlines()))


def literal(text: str) -> str:
    """A one-line JSON (and Python) string literal of ``text``: ASCII only, and ``<``, ``>``,
    ``&`` escaped too, so no HTML survives even where the Markdown is not rendered as such."""
    return (
        json.dumps(text, ensure_ascii=True)
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
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


def _fence(lines: Sequence[str], info: str = "text") -> list[str]:
    return [f"```{info}", *lines, "```", ""]


def _columns_table(schema_name: str, schema: object) -> list[str]:
    import pyarrow as pa

    assert isinstance(schema, pa.Schema)
    out = [
        f"Columns of `{schema_name}`:",
        "",
        "| column | Arrow type | nullable | meaning |",
        "|---|---|---|---|",
    ]
    for f in schema:
        doc = (f.metadata or {}).get(b"doc", b"").decode()
        out.append(
            f"| `{f.name}` | `{f.type}` | {'yes' if f.nullable else 'no'} | {md_escape(doc)} |"
        )
    return [*out, ""]


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
    return _fence(
        ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    )


def _example_layers(facts: RunFacts, data: HistoryFacts | None) -> tuple[str, list[str]]:
    executed = [i.name for i in facts.layers if data and data.layer_rows.get(i.name, (0, 0))[0]]
    focus = list(facts.focus_layers)
    first = (focus or executed or [i.name for i in facts.layers] or ["encoder.0"])[0]
    compare = (focus or executed or [first])[:3]
    return first, compare


def _queries(directory: Path | str, facts: RunFacts, data: HistoryFacts | None) -> list[str]:
    layer, compare = _example_layers(facts, data)
    metric = "std" if "std" in facts.metrics or not facts.metrics else facts.metrics[0]
    formats = [f for f in PRECISION_FORMATS if f"underflow_fraction.{f}" in facts.metrics]
    fmt = formats[0] if formats else "float8_e4m3fn"
    run_dir = literal(str(directory))
    code = [
        "import json",
        "from pathlib import Path",
        "",
        "import polars as pl",
        "",
        f"RUN = Path({run_dir})  # this directory; change it if the run was moved",
        'history = pl.scan_parquet(RUN / "history.parquet")',
        "",
        "# One metric of one layer over time (always order by sample_id).",
        "trend = (",
        "    history.filter(",
        f'        (pl.col("layer") == {literal(layer)})',
        '        & (pl.col("signal") == "output")',
        f'        & (pl.col("metric") == {literal(metric)})',
        "    )",
        '    .select("sample_id", "timestamp", "call_index", "tensor_path", "value")',
        '    .sort("sample_id")',
        "    .collect()",
        ")",
        "",
        "# Latest value of every metric, per layer / call / signal / tensor path.",
        "latest = (",
        '    history.sort("sample_id")',
        '    .group_by("layer", "call_index", "signal", "tensor_path", "metric")',
        '    .agg(pl.col("sample_id").last(), pl.col("value").last())',
        '    .sort("layer", "call_index", "signal", "tensor_path", "metric")',
        "    .collect()",
        ")",
        "",
        "# Side by side: the mean of each sample's metric for a few layers.",
        "side_by_side = (",
        "    history.filter(",
        f'        pl.col("layer").is_in([{", ".join(literal(n) for n in compare)}])',
        f'        & (pl.col("metric") == {literal(metric)})',
        "    )",
        '    .group_by("layer", "signal")',
        '    .agg(pl.col("value").mean().alias("mean_over_samples"), pl.len().alias("rows"))',
        '    .sort("layer", "signal")',
        "    .collect()",
        ")",
        "",
        "# Why values are missing.",
        "missing = (",
        '    history.filter(pl.col("value").is_null())',
        '    .group_by("layer", "signal", "metric", "unavailable_reason")',
        '    .agg(pl.len().alias("rows"))',
        '    .sort("rows", descending=True)',
        "    .collect()",
        ")",
        "",
        "# Aggregates of one layer from result.json.",
        'records = json.loads((RUN / "result.json").read_text(encoding="utf-8"))',
        f'record = next(r for r in records if r["layer"] == {literal(layer)})',
        "",
        "# Histograms of the focus layers, without TensorBoard.",
        'histograms = pl.scan_parquet(RUN / "histograms.parquet")',
        "",
        "",
        "# Parameters (recorded when the observer was given",
        '# signals=[..., "parameter", "parameter_update"]; empty frames otherwise).',
        "# The L2 norm of a tensor from its mean, std and shape: over its n finite entries,",
        "# sum(x**2) = n * (std**2 + mean**2), so ||x||_2 = sqrt(n * (std**2 + mean**2)),",
        "# n = prod(shape) * (1 - nonfinite_fraction).",
        "def l2_norm(signal):",
        "    return (",
        '        history.filter(pl.col("signal") == signal)',
        '        .group_by("layer", "tensor_path", "sample_id")',
        "        .agg(",
        '            pl.col("value").filter(pl.col("metric") == "mean").first().alias("mean"),',
        '            pl.col("value").filter(pl.col("metric") == "std").first().alias("std"),',
        '            pl.col("value")',
        '            .filter(pl.col("metric") == "nonfinite_fraction")',
        "            .first()",
        '            .alias("nonfinite"),',
        '            pl.col("shape")',
        "            .first()",
        "            .list.eval(pl.element().product())",
        "            .list.first()",
        '            .alias("numel"),',
        "        )",
        "        .with_columns(",
        "            norm=(",
        '                pl.col("numel")',
        '                * (1 - pl.col("nonfinite"))',
        '                * (pl.col("std") ** 2 + pl.col("mean") ** 2)',
        "            ).sqrt()",
        "        )",
        "    )",
        "",
        "",
        "# Weight norm per layer and parameter over time.",
        "weight_norm = (",
        '    l2_norm("parameter")',
        '    .select("layer", "tensor_path", "sample_id", "norm")',
        '    .sort("layer", "tensor_path", "sample_id")',
        "    .collect()",
        ")",
        "",
        "# Update-to-weight ratio per layer and parameter over time: how far each optimizer",
        "# step moved the parameter, relative to its size (the learning-rate diagnostic).",
        "update_to_weight = (",
        '    l2_norm("parameter_update")',
        '    .join(l2_norm("parameter"), on=["layer", "tensor_path", "sample_id"], suffix="_w")',
        "    .select(",
        '        "layer",',
        '        "tensor_path",',
        '        "sample_id",',
        '        (pl.col("norm") / pl.col("norm_w")).alias("update_to_weight"),',
        "    )",
        '    .sort("layer", "tensor_path", "sample_id")',
        "    .collect()",
        ")",
        "",
        "# Low precision (recorded when the observer was given precision=(...); an empty",
        "# frame otherwise): amax and dynamic range of each tensor, derived from min, max and",
        "# min_abs_nonzero (amax = max(|min|, |max|), dynamic range = amax / min_abs_nonzero,",
        f"# log2 of it in binades), beside what a cast to {fmt} would lose.",
        "def value_of(metric):",
        '    return pl.col("value").filter(pl.col("metric") == metric).first()',
        "",
        "",
        "low_precision = (",
        "    history.group_by(",
        '        "layer", "call_index", "signal", "tensor_path", "sample_id", maintain_order=True',
        "    )",
        "    .agg(",
        *(
            f"        value_of({literal(name)}).alias({literal(alias)}),"
            for name, alias in (
                ("min", "min"),
                ("max", "max"),
                ("min_abs_nonzero", "min_abs_nonzero"),
                (f"underflow_fraction.{fmt}", "underflow"),
                (f"overflow_fraction.{fmt}", "overflow"),
            )
        ),
        "    )",
        '    .filter(pl.col("min_abs_nonzero").is_not_null())',
        '    .with_columns(amax=pl.max_horizontal(pl.col("min").abs(), pl.col("max").abs()))',
        "    .with_columns(",
        '        dynamic_range=pl.col("amax") / pl.col("min_abs_nonzero"),',
        '        binades=(pl.col("amax") / pl.col("min_abs_nonzero")).log(2),',
        "    )",
        '    .sort("layer", "call_index", "signal", "tensor_path", "sample_id")',
        "    .collect()",
        ")",
        "",
        "# While the run is live (before removal), read the published parts instead:",
        "# from ti_io import scan_history; live = scan_history(RUN)",
    ]
    return _fence(_for_location(directory, code), "python")


EVENTS_LISTED: Final[int] = 20
"""Events index.md describes one by one (with their queries); the rest are counted."""


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


def _event_queries(directory: Path | str, events: Sequence[Mapping[str, Any]]) -> list[str]:
    code = [
        "import polars as pl",
        "from pathlib import Path",
        "",
        f"RUN = Path({literal(str(directory))})  # this directory; change it if the run was moved",
        'history = pl.scan_parquet(RUN / "history.parquet")',
        'events = pl.read_parquet(RUN / "events.parquet")  # every event, one row each',
    ]
    for index, event in enumerate(events[:EVENTS_LISTED]):
        first, count = int(event["dense_first_forward"]), int(event["dense_forwards"])
        code += [
            "",
            f"# Event #{index} ({event['kind']} at forward {event['forward_index']}): the history "
            "rows of its dense capture.",
            f"dense_{index} = (",
            "    history.filter(",
            f'        (pl.col("rank") == {int(event["rank"])})',
            f'        & pl.col("forward_index").is_between({first}, {first + count - 1})',
            "    )",
            '    .sort("sample_id", "layer", "call_index", "signal", "tensor_path", "metric")',
            "    .collect()",
            ")",
        ]
        if event.get("layer") is not None:
            code += [
                "# ... and the non-finite fraction of the first flagged module around it.",
                f"first_module_{index} = (",
                "    history.filter(",
                f'        (pl.col("rank") == {int(event["rank"])})',
                f'        & (pl.col("layer") == {literal(str(event["layer"]))})',
                '        & (pl.col("metric") == "nonfinite_fraction")',
                "    )",
                '    .select("forward_index", "sample_id", "signal", "tensor_path", "value")',
                '    .sort("sample_id")',
                "    .collect()",
                ")",
            ]
    return _fence(_for_location(directory, code), "python")


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
    lines += _fence(block)
    lines += ["Their dense samples (Python, Polars):", "", *_event_queries(directory, events)]
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
            *_fence([literal(entry) for entry in entries]),
        ]
    lines += _events_section(directory, events, live=live)
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
    lines += ["## Run", "", *_fence(facts_block)]
    lines += [
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
        *_columns_table("ti.history", history_schema()),
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
        *_columns_table("ti.events", events_schema()),
        "Metrics (values of the `metric` column):",
        "",
        "| metric | definition |",
        "|---|---|",
    ]
    for metric in facts.metrics or tuple(METRIC_DEFINITIONS):
        spec = declared_metric(metric)
        definition = spec.definition if spec else "custom reducer (defined by the producer)"
        lines.append(f"| {md_escape(metric)} | {md_escape(definition)} |")
    lines += [
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
        lines += _fence(block)
    lines += [
        "## Queries",
        "",
        "Ready to run (Python, Polars):",
        "",
        *_queries(directory, facts, data),
    ]
    return "\n".join(lines)


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


_RUN_PATH: Final[re.Pattern[str]] = re.compile(r'RUN / "([^"]+)"')


def _for_location(directory: Path | str, code: list[str]) -> list[str]:
    """``code`` for a run on an object store (``directory`` its URI): RUN is the URI string,
    files are ``f"{RUN}/name"`` (Polars reads them with ``storage_options``), result.json is
    read through ti-io. Unchanged for a local directory."""
    if not isinstance(directory, str):
        return code
    out = []
    for line in code:
        if line.startswith("RUN = Path("):
            line = (
                f"RUN = {literal(directory)}  # this run on object storage (Polars: add "
                "storage_options=, docs/reading-with-polars.md)"
            )
        elif '(RUN / "result.json").read_text(' in line:
            out.append("from ti_io.storage import read_text, resolve_location")
            line = 'records = json.loads(read_text(resolve_location(RUN) / "result.json") or "[]")'
        out.append(_RUN_PATH.sub(r'f"{RUN}/\1"', line))
    return out
