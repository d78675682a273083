"""The ``ti`` command: ``ti summary DIR``, ``ti validate DIR``, ``ti consolidate DIR``,
``ti upgrade OLD_DIR NEW_DIR``.

Every command first recognizes a run directory written by torchinstruments 0.8.0 and says so in
one line (exit 1), pointing at ``ti upgrade``, instead of failing on its columns."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from ti_io.config import HistoryConfig
from ti_io.consolidate import consolidate
from ti_io.errors import FinalizationError, NothingToConsolidateError
from ti_io.facts import read_catalog, read_run_facts
from ti_io.journal import read_journal
from ti_io.legacy import UpgradeError, upgrade, upgraded_from
from ti_io.legacy_layout import check_not_legacy
from ti_io.readers import scan_history
from ti_io.result_json import TENSOR_KEYS, aggregate
from ti_schema import DEFAULT_METRICS, SIGNALS, Signal
from ti_schema.artifacts import artifact_dir_problems
from ti_schema.layout import HISTORY_FILE, JOURNAL_FILE, list_rank_dirs


def display_name(name: str) -> str:
    """A layer name safe to print in a terminal: control characters escaped, root shown."""
    if not name:
        return "(root)"
    if name.isprintable():
        return name
    return json.dumps(name, ensure_ascii=False)[1:-1]


def _summary_frame(
    directory: Path, metrics: Sequence[str], signals: Sequence[Signal]
) -> pl.DataFrame:
    facts = read_run_facts(directory)
    history = scan_history(directory)
    if metrics:
        history = history.filter(pl.col("metric").is_in(list(metrics)))
    if signals:
        history = history.filter(pl.col("signal").is_in(list(signals)))
    keys = [*TENSOR_KEYS, "metric"]
    latest = history.group_by(keys).agg(
        pl.col("value").sort_by("sample_id").last().alias("latest"),
        pl.col("sample_id").max().alias("latest_sample"),
    )
    table = (
        aggregate(history, facts.window)  # the run's window: run.json live, the footer after
        .join(latest, on=keys, how="left")
        .select(
            *keys,
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
        .collect()
    )
    catalog = facts.layers or read_catalog(directory) or ()
    order = {info.name: i for i, info in enumerate(catalog)}
    # A finalized run no longer holds run.json: fall back to the contract's default order.
    metric_order = {m: i for i, m in enumerate(facts.metrics or DEFAULT_METRICS)}
    executed = set(table.get_column("layer").to_list())
    missing = [info.name for info in catalog if info.name not in executed]
    table = table.with_columns(
        pl.col("layer")
        .replace_strict(order, default=len(order), return_dtype=pl.Int64)
        .alias("_layer_order"),
        pl.col("metric")
        .replace_strict(metric_order, default=len(metric_order), return_dtype=pl.Int64)
        .alias("_metric_order"),
    ).sort("_layer_order", "layer", "call_index", "signal", "tensor_path", "_metric_order")
    table = table.drop("_layer_order", "_metric_order").with_columns(
        pl.col("layer").map_elements(display_name, return_dtype=pl.String),
        pl.col("tensor_path").map_elements(
            lambda p: display_name(p) if p else "", return_dtype=pl.String
        ),
    )
    for column in ("mode", "grad_enabled", "tensor_path"):
        if table.get_column(column).n_unique() <= 1:
            table = table.drop(column)  # one context for the whole run: nothing to show
    table = table.rename({"call_index": "call", "latest_sample": "sample"})
    if missing:
        unexecuted = pl.DataFrame(
            {
                "layer": [display_name(n) for n in missing],
                "signal": ["(not executed)"] * len(missing),
            }
        )
        table = pl.concat([table, unexecuted], how="diagonal_relaxed")
    return table


def _summary(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    table = _summary_frame(directory, args.metric or [], args.signal or [])
    live = not (directory / HISTORY_FILE).is_file()
    status = "live or unconsolidated (from history.parts)" if live else "finalized"
    window = read_run_facts(directory).window
    print(f"{directory}: {status}; recent_window_mean over the last window {window} samples")
    upgraded = upgraded_from(directory)
    if upgraded is not None:
        source, unrecorded = upgraded
        print(
            f"upgraded from {source}, which did not record {', '.join(unrecorded) or 'nothing'}: "
            "those columns hold placeholders"
        )
    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_width_chars=240,
        fmt_str_lengths=48,
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        float_precision=6,
    ):
        print(table)
    return 0


def _journals(root: Path) -> tuple[list[str], list[str]]:
    """Problems with the finalization journals of ``root`` (or of its rank directories), and a
    note for each run whose finalization was interrupted."""
    problems: list[str] = []
    notes: list[str] = []
    runs = [child for _, child in list_rank_dirs(root)] or [root]
    for run in runs:
        try:
            journal = read_journal(run)
        except (OSError, ValueError) as exc:
            problems.append(f"{run / JOURNAL_FILE}: {exc}")
            continue
        if journal is not None:
            notes.append(
                f"{run}: its finalization was interrupted after the step {journal.state.value!r} "
                f"({JOURNAL_FILE}); `ti consolidate {run}` finishes it"
            )
    return problems, notes


def _validate(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    try:
        # Live and interrupted runs are checked as they stand: parts, catalog and index.md.
        problems = [str(p) for p in artifact_dir_problems(root, allow_live=True)]
    except NotADirectoryError as exc:
        print(f"ti validate: {exc}", file=sys.stderr)
        return 1
    journal_problems, notes = _journals(root)
    problems += journal_problems
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if problems:
        print(f"{root}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("ok")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    config = HistoryConfig(window=args.window) if args.window is not None else None
    try:
        done = consolidate(args.dir, history_config=config, force=args.force)
    except (NothingToConsolidateError, RuntimeError, FinalizationError) as exc:
        print(f"ti consolidate: {exc}", file=sys.stderr)
        return 1
    if done.already_done:
        print(f"{done.directory}: already consolidated ({done.history_rows} history rows)")
    elif done.resumed_from is not None:
        print(
            f"{done.directory}: resumed the interrupted finalization (journal state "
            f"{done.resumed_from!r}) and finished it: {done.history_rows} history rows and "
            f"{done.histogram_rows} histogram rows"
            + (f", from {done.parts} parts" if done.parts else "")
        )
    else:
        print(
            f"{done.directory}: consolidated {done.parts} parts into {done.history_rows} history "
            f"rows and {done.histogram_rows} histogram rows"
        )
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    try:
        done = upgrade(args.old_dir, args.new_dir)
    except UpgradeError as exc:
        print(f"ti {exc}", file=sys.stderr)
        return 1
    for run in done.runs:
        state = "interrupted run (from its parts)" if run.interrupted else "run"
        print(
            f"{run.destination}: upgraded the torchinstruments 0.8.0 {state} {run.source} "
            f"({run.history_rows} history rows, rank {run.rank}; not recorded by 0.8.0, "
            f"placeholders: {', '.join(run.unrecorded)})"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ti", description="Read, check and finish TorchInstruments run directories."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser(
        "summary", help="per-layer table of latest and aggregate values (live runs too)"
    )
    summary.add_argument("dir", help="a run directory (the output_dir)")
    summary.add_argument(
        "--metric", action="append", help="only this metric (repeatable), e.g. --metric std"
    )
    summary.add_argument(
        "--signal",
        action="append",
        choices=SIGNALS,
        help="only this signal (repeatable)",
    )
    summary.set_defaults(run=_summary)
    validate = commands.add_parser(
        "validate", help="check every artifact against ti-schema; exit 1 listing mismatches"
    )
    validate.add_argument("dir", help="a run directory, or a directory of rank-NNN runs")
    validate.set_defaults(run=_validate)
    finish = commands.add_parser(
        "consolidate", help="finish an interrupted run from its parts (what removal does)"
    )
    finish.add_argument("dir", help="the run directory holding history.parts/")
    finish.add_argument(
        "--window", type=int, default=None, help="result.json window (default: the run's)"
    )
    finish.add_argument(
        "--force",
        action="store_true",
        help="consolidate even if the process that wrote the run seems alive",
    )
    finish.set_defaults(run=_consolidate)
    convert = commands.add_parser(
        "upgrade",
        help="convert a run written by torchinstruments 0.8.0 into a new directory",
    )
    convert.add_argument("old_dir", help="the 0.8.0 run directory (only read)")
    convert.add_argument("new_dir", help="where the upgraded run goes (new or empty)")
    convert.set_defaults(run=_upgrade)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ti`` console script."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in _ACTIONS:  # consolidate checks for itself, naming how to go on
            check_not_legacy(args.dir, _ACTIONS[args.command])
        code = int(args.run(args))
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (OSError, ValueError) as exc:  # LegacyRunError, a failing disk: one line, exit 1
        print(f"ti {args.command}: {exc}", file=sys.stderr)
        return 1


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``ti summary DIR | head``): stop quietly, as Unix
    tools do. Python flushes stdout again at exit, so stdout is pointed at the null device
    first; the exit status is the shell's for a command stopped by SIGPIPE (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


_ACTIONS = {
    "summary": "summarized",
    "validate": "validated against the current contract",
}


if __name__ == "__main__":
    sys.exit(main())
