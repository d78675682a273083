"""``ti summary DIR``: per-layer table of latest and aggregate values (live runs too)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from ti_io.cli.options import machine_output, progress_flag
from ti_io.cli.output import escaped, print_table, without_constant_context, write_machine
from ti_io.cli.status import OK
from ti_io.damaged import gap_lines
from ti_io.facts import read_run_facts
from ti_io.finish.upgrade import upgraded_from
from ti_io.progress import TerminalProgress
from ti_io.read.events import describe_event, event_records, read_events
from ti_io.read.ordering import TENSOR_KEYS
from ti_io.read.summary import display_name, summary_table
from ti_schema import SIGNALS
from ti_schema.layout import HISTORY_FILE

if TYPE_CHECKING:
    from ti_io.cli.options import Commands


def add_parser(commands: Commands) -> None:
    """Register ``ti summary`` with the subparsers of ``ti``."""
    summary = commands.add_parser(
        "summary", help="per-layer table of latest and aggregate values (live runs too)"
    )
    summary.add_argument(
        "dir", help="a run directory (the output_dir), or its URI (s3://bucket/run, gs://...)"
    )
    summary.add_argument(
        "--layer",
        action="append",
        metavar="GLOB",
        help="only layers matching this glob (repeatable), e.g. --layer 'encoder.*'",
    )
    summary.add_argument(
        "--metric", action="append", help="only this metric (repeatable), e.g. --metric std"
    )
    summary.add_argument(
        "--signal",
        action="append",
        choices=SIGNALS,
        help="only this signal (repeatable)",
    )
    machine_output(summary)
    progress_flag(summary)
    summary.set_defaults(
        run=run, paths=("dir",), refuses_legacy="summarized", remote_reads=("dir",)
    )


def _view(raw: pl.DataFrame) -> pl.DataFrame:
    """The table ``ti summary`` prints: :func:`~ti_io.read.summary.summary_table` with names
    escaped, the root shown as ``(root)``, single-valued context columns dropped and
    unexecuted layers marked."""
    executed = raw.filter(pl.col("executed"))
    table = executed.select(
        *TENSOR_KEYS,
        "metric",
        "latest_sample",
        "latest",
        "mean",
        "std",
        "min",
        "p50",
        "max",
        "recent_window_mean",
        "observations",
        "unavailable",
    )
    table = without_constant_context(escaped(table))
    table = table.rename({"call_index": "call", "latest_sample": "sample"})
    missing = raw.filter(~pl.col("executed")).get_column("layer").to_list()
    if missing:
        unexecuted = pl.DataFrame(
            {
                "layer": [display_name(n) for n in missing],
                "signal": ["(not executed)"] * len(missing),
            }
        )
        table = pl.concat([table, unexecuted], how="diagonal_relaxed")
    return table


def event_lines(directory: Path) -> list[str]:
    """The events of the run, one line each (kind, forward, signal, first module, rank), with
    a heading; nothing for a run without events."""
    events = event_records(read_events(directory))
    if not events:
        return []
    return [
        f"{len(events)} event(s) (events.parquet; ti_io.read_events):",
        *(f"  {describe_event(event)}" for event in events),
    ]


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    with TerminalProgress("summary", "rows", enabled=args.progress) as progress:
        raw = summary_table(
            directory, args.metric or [], args.signal or [], args.layer or [], progress=progress
        )
    if args.format:
        write_machine(raw, args.format)
        return OK
    table = _view(raw)
    live = not (directory / HISTORY_FILE).is_file()
    status = "live or unconsolidated (from history.parts)" if live else "finalized"
    facts = read_run_facts(directory)
    print(f"{directory}: {status}; recent_window_mean over the last window {facts.window} samples")
    cost = facts.telemetry_cost
    print(f"telemetry cost: {cost.describe() if cost is not None else 'unknown (not reported)'}")
    for line in gap_lines(facts.skipped):  # a history with a hole is never read unknowingly
        print(f"GAP: {line}")
    upgraded = upgraded_from(directory)
    if upgraded is not None:
        source, unrecorded = upgraded
        print(
            f"upgraded from {source}, which did not record {', '.join(unrecorded) or 'nothing'}: "
            "those columns hold placeholders"
        )
    for line in event_lines(directory):
        print(line)
    print_table(table)
    return OK
