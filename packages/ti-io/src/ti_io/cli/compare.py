"""``ti compare RUN RUN...``: two or more matched runs side by side, aligned by sample id."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

import polars as pl

from ti_io.cli.options import machine_output, positive, progress_flag, sample_id
from ti_io.cli.output import escaped, print_table, without_constant_context, write_machine
from ti_io.cli.status import OK, UsageError
from ti_io.progress import TerminalProgress
from ti_io.read.compare import ComparedRun, compare_runs, compare_series, open_runs, unshared
from ti_io.read.events import describe_event, event_records, read_events
from ti_io.read.ordering import TENSOR_KEYS
from ti_schema import SIGNALS

if TYPE_CHECKING:
    from ti_io.cli.options import Commands


def add_parser(commands: Commands) -> None:
    """Register ``ti compare`` with the subparsers of ``ti``."""
    compare = commands.add_parser(
        "compare",
        help="two or more runs side by side, aligned by sample id (matched runs)",
        description=(
            "Compare runs measurement by measurement (layer, call, signal, tensor path, context, "
            "metric), aligned on the sample ids every run holds: latest value, window means, "
            "means before and after --onset, and each run's ratio to the first run. Measurements "
            "some run lacks are listed, never dropped."
        ),
    )
    compare.add_argument(
        "runs", nargs="+", metavar="RUN", help="run directories or URIs (two or more)"
    )
    compare.add_argument(
        "--layer",
        action="append",
        metavar="GLOB",
        help="only layers matching this glob (repeatable)",
    )
    compare.add_argument(
        "--signal", action="append", choices=SIGNALS, help="only this signal (repeatable)"
    )
    compare.add_argument("--metric", action="append", help="only this metric (repeatable)")
    compare.add_argument(
        "--onset",
        type=sample_id,
        metavar="SAMPLE",
        help="a sample id: add the means before it and from it on",
    )
    compare.add_argument(
        "--window",
        type=positive,
        default=None,
        help="samples per window mean (default: the first run's window)",
    )
    compare.add_argument(
        "--plot",
        metavar="FILE.png",
        help='also draw the aligned series as a PNG (needs `pip install "ti-io[plot]"`)',
    )
    machine_output(compare)
    progress_flag(compare)
    compare.set_defaults(
        run=run,
        paths=("runs",),
        refuses_legacy="compared",
        check_usage=check_usage,
        remote_reads=("runs",),
    )


def _describe_runs(runs: list[ComparedRun], window: int) -> list[str]:
    shared = sorted(set.intersection(*(set(run.samples) for run in runs)))
    span = f"{shared[0]}..{shared[-1]}" if shared else "none"
    lines = [
        f"compared on the {len(shared)} sample ids every run holds ({span}); window means over "
        f"{window} samples; ratios divide by the first run ({runs[0].label})"
    ]
    width = max(len(run.label) for run in runs)
    for run in runs:
        state = "finalized" if run.finalized else "live or unconsolidated"
        contract = f"contract {run.contract_version}" if run.contract_version else "no rows yet"
        extra = len(set(run.samples) - set(shared))
        not_shared = f", {extra} samples the others lack (not compared)" if extra else ""
        events = event_records(read_events(run.directory))
        lines.append(
            f"  {run.label:<{width}}  {run.directory} ({state}, {contract}, "
            f"{len(run.samples)} samples{not_shared}, {len(events)} event(s))"
        )
        if events:
            lines.append(f"  {'':<{width}}  first event: {describe_event(events[0])}")
    return lines


def _display(table: pl.DataFrame, onset: int | None) -> pl.DataFrame:
    shared = table.filter(pl.col("in_run").all().over([*TENSOR_KEYS, "metric"]))
    shown = escaped(shared).with_columns(
        pl.format("{}/{}", "measured", "samples").alias("measured"),
    )
    columns: list[Any] = [
        *TENSOR_KEYS,
        "metric",
        "run",
        "measured",
        pl.col("latest_sample").alias("sample"),
        "latest",
        pl.col("recent_window_mean").alias("recent_mean"),
        pl.col("previous_window_mean").alias("previous_mean"),
    ]
    if onset is not None:
        columns += [
            "before_mean",
            "after_mean",
            pl.format("{}/{}", "measured_after", "samples_after").alias("measured_after"),
        ]
    columns += ["latest_ratio", "recent_ratio"]
    if onset is not None:
        columns.append("after_ratio")
    shown = without_constant_context(shown.select(columns))
    return shown.rename({"call_index": "call"})


def _unshared_display(table: pl.DataFrame) -> pl.DataFrame:
    lacking = unshared(table)
    grouped = lacking.group_by([*TENSOR_KEYS, "in_runs", "missing_in"], maintain_order=True).agg(
        pl.col("metric").str.join(", ").alias("metrics")
    )
    return (
        escaped(grouped)
        .with_columns(
            pl.col("in_runs").list.join(", ").alias("in"),
            pl.col("missing_in").list.join(", ").alias("missing in"),
        )
        .select(
            "layer",
            pl.col("call_index").alias("call"),
            "signal",
            "tensor_path",
            "mode",
            "metrics",
            "in",
            "missing in",
        )
    )


def check_usage(args: argparse.Namespace) -> None:
    """Raise UsageError for fewer than two runs (before the runs are read)."""
    if len(args.runs) < 2:
        raise UsageError(f"compare two or more runs, got {len(args.runs)}")


def run(args: argparse.Namespace) -> int:
    filters = {"layer": args.layer, "signal": args.signal, "metric": args.metric}
    runs = open_runs(args.runs)
    window = args.window if args.window is not None else runs[0].window
    with TerminalProgress("compare", "rows", enabled=args.progress) as progress:
        table = compare_runs(
            args.runs, onset=args.onset, window=args.window, progress=progress, **filters
        )
    if args.plot is not None:
        try:
            from ti_io.read.plot import plot_series
        except ImportError as exc:
            raise RuntimeError(str(exc)) from exc
        series = compare_series(args.runs, **filters)
        try:
            written = plot_series(series, args.plot, onset=args.onset, title="ti compare")
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        print(f"plot: {written}", file=sys.stderr if args.format else sys.stdout)
    if args.format:
        write_machine(table, args.format)
        return OK
    for line in _describe_runs(runs, window):
        print(line)
    print_table(_display(table, args.onset))
    lacking = _unshared_display(table)
    if lacking.height:
        print(
            f"{unshared(table).height} measurements are not in every run (their rows are in "
            "--csv/--json, with in_run false where missing):"
        )
        print_table(lacking)
    return OK
