"""The ``ti`` command: ``ti summary``, ``ti compare``, ``ti validate``, ``ti consolidate``,
``ti upgrade`` and ``ti --version``.

Every command first recognizes a run directory written by torchinstruments 0.8.0 and says so in
one line (exit 1), pointing at ``ti upgrade``, instead of failing on its columns. Exit codes
follow the Unix tools (:data:`EXIT_CODES`, printed by ``ti --help``). Machine output
(``--csv``, ``--json``) goes to stdout alone; progress bars and notes go to stderr.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import textwrap
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import polars as pl

from ti_io.compare import ComparedRun, compare_runs, compare_series, open_runs, unshared
from ti_io.config import HistoryConfig
from ti_io.consolidate import consolidate
from ti_io.errors import FinalizationError, NothingToConsolidateError
from ti_io.facts import read_catalog, read_run_facts
from ti_io.journal import read_journal
from ti_io.legacy import UpgradeError, upgrade, upgraded_from
from ti_io.legacy_layout import check_not_legacy
from ti_io.progress import TerminalProgress
from ti_io.readers import scan_history
from ti_io.result_json import AGGREGATES, TENSOR_KEYS, aggregate
from ti_schema import DEFAULT_METRICS, SCHEMA_VERSION, SIGNALS, Signal
from ti_schema.artifacts import artifact_dir_problems
from ti_schema.layout import HISTORY_FILE, JOURNAL_FILE, list_rank_dirs

OK: Final[int] = 0
REFUSED: Final[int] = 1
USAGE: Final[int] = 2
PIPE_CLOSED: Final[int] = 141
EXIT_CODES: Final[tuple[tuple[int, str], ...]] = (
    (OK, "success (ti validate: the run conforms)"),
    (
        REFUSED,
        "the run does not conform (ti validate), or the command refused the run: not a run, "
        "a torchinstruments 0.8.0 run, nothing to consolidate, the writer is still alive, "
        "another finalizer at work, a file operation that failed (the message names the "
        "command that finishes), a finished file that would shrink, an occupied upgrade "
        "destination, runs that share no layer, a --layer or --metric filter that matches "
        "nothing",
    ),
    (USAGE, "usage error: unknown option or bad value, a path that does not exist"),
    (PIPE_CLOSED, "the reader of the output went away (ti summary DIR | head)"),
)
"""The exit status of every ``ti`` command, as ``ti --help`` lists them."""

TI_DISTRIBUTIONS: Final[tuple[str, ...]] = (
    "ti-schema",
    "ti-core",
    "ti-io",
    "ti-dist",
    "ti-trainers",
    "ti-examples",
)
"""The TorchInstruments distributions ``ti --version`` reports when installed."""

TERMINAL_TABLE: Final[dict[str, Any]] = {
    "tbl_rows": -1,
    "tbl_cols": -1,
    "tbl_width_chars": 240,
    "fmt_str_lengths": 48,
    "tbl_hide_dataframe_shape": True,
    "tbl_hide_column_data_types": True,
    "float_precision": 6,
}


class UsageError(ValueError):
    """A command line that cannot be run as given (exit 2)."""


def display_name(name: str) -> str:
    """A layer name safe to print in a terminal: control characters escaped, root shown."""
    if not name:
        return "(root)"
    if name.isprintable():
        return name
    return json.dumps(name, ensure_ascii=False)[1:-1]


def matching_layers(names: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The names matched by any glob of ``patterns`` (``fnmatch`` rules, case-sensitive)."""
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def summary_table(
    directory: Path,
    metrics: Sequence[str] = (),
    signals: Sequence[Signal] = (),
    layers: Sequence[str] = (),
) -> pl.DataFrame:
    """What ``ti summary`` reports, for machines: one row per tensor, context and metric
    (``TENSOR_KEYS``, ``metric``, ``latest_sample``, ``latest``, every result.json aggregate,
    ``executed`` true), then one row per catalog layer that never ran (``executed`` false,
    everything else null). ``layers`` are globs; layer names are unescaped."""
    facts = read_run_facts(directory)
    history = scan_history(directory)
    catalog = [info.name for info in facts.layers or read_catalog(directory) or ()]
    if layers:
        present = history.select(pl.col("layer").unique()).collect().get_column("layer")
        known = list(dict.fromkeys([*catalog, *present.to_list()]))
        chosen = matching_layers(known, layers)
        if not chosen:
            raise ValueError(
                f"--layer {' '.join(map(repr, layers))} matches no layer of {directory}; it holds "
                + ", ".join(display_name(n) for n in known[:8])
                + (", ..." if len(known) > 8 else "")
            )
        history = history.filter(pl.col("layer").is_in(chosen))
        catalog = [name for name in catalog if name in chosen]
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
        .select(*keys, "latest_sample", "latest", "observations", "unavailable", *AGGREGATES)
        .with_columns(pl.lit(True).alias("executed"))
        .collect()
    )
    order = {name: i for i, name in enumerate(catalog)}
    # A finalized run no longer holds run.json: fall back to the contract's default order.
    metric_order = {m: i for i, m in enumerate(facts.metrics or DEFAULT_METRICS)}
    executed = set(table.get_column("layer").to_list())
    table = (
        table.with_columns(
            pl.col("layer")
            .replace_strict(order, default=len(order), return_dtype=pl.Int64)
            .alias("_layer_order"),
            pl.col("metric")
            .replace_strict(metric_order, default=len(metric_order), return_dtype=pl.Int64)
            .alias("_metric_order"),
        )
        .sort("_layer_order", "layer", "call_index", "signal", "tensor_path", "_metric_order")
        .drop("_layer_order", "_metric_order")
    )
    missing = [name for name in catalog if name not in executed]
    if missing:
        unexecuted = pl.DataFrame(
            {"layer": missing, "executed": [False] * len(missing)},
            schema={"layer": pl.String, "executed": pl.Boolean},
        )
        table = pl.concat([table, unexecuted], how="diagonal_relaxed")
    return table


def _summary_frame(
    directory: Path,
    metrics: Sequence[str],
    signals: Sequence[Signal],
    layers: Sequence[str] = (),
) -> pl.DataFrame:
    """The table ``ti summary`` prints: :func:`summary_table` with names escaped, the root
    shown as ``(root)``, single-valued context columns dropped and unexecuted layers marked."""
    raw = summary_table(directory, metrics, signals, layers)
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
    table = _escaped(table)
    for column in ("mode", "grad_enabled", "tensor_path"):
        if table.get_column(column).n_unique() <= 1:
            table = table.drop(column)  # one context for the whole run: nothing to show
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


def _escaped(table: pl.DataFrame) -> pl.DataFrame:
    return table.with_columns(
        pl.col("layer").map_elements(display_name, return_dtype=pl.String),
        pl.col("tensor_path").map_elements(
            lambda p: display_name(p) if p else "", return_dtype=pl.String
        ),
    )


def _write_machine(table: pl.DataFrame, fmt: str) -> None:
    """``table`` as CSV or strict JSON (an array of objects; NaN and infinity as null)."""
    if fmt == "csv":
        sys.stdout.write(table.write_csv())
        return
    rows = [{k: _strict(v) for k, v in row.items()} for row in table.iter_rows(named=True)]
    sys.stdout.write(json.dumps(rows, ensure_ascii=False, allow_nan=False) + "\n")


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def _print_table(table: pl.DataFrame) -> None:
    with pl.Config(**TERMINAL_TABLE):
        print(table)


def _summary(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    if args.format:
        _write_machine(
            summary_table(directory, args.metric or [], args.signal or [], args.layer or []),
            args.format,
        )
        return OK
    table = _summary_frame(directory, args.metric or [], args.signal or [], args.layer or [])
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
    _print_table(table)
    return OK


def _describe_runs(runs: list[ComparedRun], table: pl.DataFrame, window: int) -> list[str]:
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
        lines.append(
            f"  {run.label:<{width}}  {run.directory} ({state}, {contract}, "
            f"{len(run.samples)} samples{not_shared})"
        )
    return lines


def _compare_display(table: pl.DataFrame, onset: int | None) -> pl.DataFrame:
    shared = table.filter(pl.col("in_run").all().over([*TENSOR_KEYS, "metric"]))
    shown = _escaped(shared).with_columns(
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
    shown = shown.select(columns)
    for column in ("mode", "grad_enabled", "tensor_path"):
        if shown.get_column(column).n_unique() <= 1:
            shown = shown.drop(column)
    return shown.rename({"call_index": "call"})


def _unshared_display(table: pl.DataFrame) -> pl.DataFrame:
    lacking = unshared(table)
    grouped = lacking.group_by([*TENSOR_KEYS, "in_runs", "missing_in"], maintain_order=True).agg(
        pl.col("metric").str.join(", ").alias("metrics")
    )
    return (
        _escaped(grouped)
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


def _compare(args: argparse.Namespace) -> int:
    filters = {"layer": args.layer, "signal": args.signal, "metric": args.metric}
    runs = open_runs(args.runs)
    window = args.window if args.window is not None else runs[0].window
    table = compare_runs(args.runs, onset=args.onset, window=args.window, **filters)
    if args.plot is not None:
        try:
            from ti_io.plot import plot_series
        except ImportError as exc:
            raise RuntimeError(str(exc)) from exc
        series = compare_series(args.runs, **filters)
        try:
            written = plot_series(series, args.plot, onset=args.onset, title="ti compare")
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        print(f"plot: {written}", file=sys.stderr if args.format else sys.stdout)
    if args.format:
        _write_machine(table, args.format)
        return OK
    for line in _describe_runs(runs, table, window):
        print(line)
    _print_table(_compare_display(table, args.onset))
    lacking = _unshared_display(table)
    if lacking.height:
        print(
            f"{unshared(table).height} measurements are not in every run (their rows are in "
            "--csv/--json, with in_run false where missing):"
        )
        _print_table(lacking)
    return OK


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
        return REFUSED
    journal_problems, notes = _journals(root)
    problems += journal_problems
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if problems:
        print(f"{root}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  - {problem}")
        return REFUSED
    print("ok")
    return OK


def _consolidate(args: argparse.Namespace) -> int:
    config = HistoryConfig(window=args.window) if args.window is not None else None
    try:
        with TerminalProgress("consolidating", "parts", enabled=args.progress) as progress:
            done = consolidate(args.dir, history_config=config, force=args.force, progress=progress)
    except (NothingToConsolidateError, RuntimeError, FinalizationError) as exc:
        print(f"ti consolidate: {exc}", file=sys.stderr)
        return REFUSED
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
    return OK


def _upgrade(args: argparse.Namespace) -> int:
    try:
        with TerminalProgress("upgrading", "rows", enabled=args.progress) as progress:
            done = upgrade(args.old_dir, args.new_dir, progress=progress)
    except UpgradeError as exc:
        print(f"ti {exc}", file=sys.stderr)
        return REFUSED
    for run in done.runs:
        state = "interrupted run (from its parts)" if run.interrupted else "run"
        print(
            f"{run.destination}: upgraded the torchinstruments 0.8.0 {state} {run.source} "
            f"({run.history_rows} history rows, rank {run.rank}; not recorded by 0.8.0, "
            f"placeholders: {', '.join(run.unrecorded)})"
        )
    return OK


def versions() -> str:
    """``ti --version``: the data contract's version, then each installed ti distribution's."""
    lines = [f"data contract {SCHEMA_VERSION}"]
    for name in TI_DISTRIBUTIONS:
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "\n".join(lines)


def _exit_codes_help() -> str:
    width = max(len(str(code)) for code, _ in EXIT_CODES)
    lines = ["exit status:"]
    for code, meaning in EXIT_CODES:
        wrapped = textwrap.wrap(meaning, 88 - width - 4)
        lines.append(f"  {code:<{width}}  {wrapped[0]}")
        lines += [" " * (width + 4) + rest for rest in wrapped[1:]]
    return "\n".join(lines)


def _machine_output(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--csv",
        dest="format",
        action="store_const",
        const="csv",
        help="write the table as CSV to stdout (every column, names unescaped), nothing else",
    )
    group.add_argument(
        "--json",
        dest="format",
        action="store_const",
        const="json",
        help="write the table as a JSON array of objects (strict JSON: NaN and infinity as null)",
    )


def _progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )


def _sample_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a sample id (an int >= 0), got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a sample id (an int >= 0), got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ti",
        description="Read, compare, check and finish TorchInstruments run directories.",
        epilog=_exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=versions(),
        help="print the data contract's version and each installed ti package's, then exit",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser(
        "summary", help="per-layer table of latest and aggregate values (live runs too)"
    )
    summary.add_argument("dir", help="a run directory (the output_dir)")
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
    _machine_output(summary)
    summary.set_defaults(run=_summary, paths=("dir",))
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
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run directories (two or more)")
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
        type=_sample_id,
        metavar="SAMPLE",
        help="a sample id: add the means before it and from it on",
    )
    compare.add_argument(
        "--window",
        type=_positive,
        default=None,
        help="samples per window mean (default: the first run's window)",
    )
    compare.add_argument(
        "--plot",
        metavar="FILE.png",
        help='also draw the aligned series as a PNG (needs `pip install "ti-io[plot]"`)',
    )
    _machine_output(compare)
    compare.set_defaults(run=_compare, paths=("runs",))
    validate = commands.add_parser(
        "validate", help="check every artifact against ti-schema; exit 1 listing mismatches"
    )
    validate.add_argument("dir", help="a run directory, or a directory of rank-NNN runs")
    validate.set_defaults(run=_validate, paths=("dir",))
    finish = commands.add_parser(
        "consolidate", help="finish an interrupted run from its parts (what removal does)"
    )
    finish.add_argument("dir", help="the run directory holding history.parts/")
    finish.add_argument(
        "--window", type=_positive, default=None, help="result.json window (default: the run's)"
    )
    finish.add_argument(
        "--force",
        action="store_true",
        help="consolidate even if the process that wrote the run seems alive",
    )
    _progress_flag(finish)
    finish.set_defaults(run=_consolidate, paths=("dir",))
    convert = commands.add_parser(
        "upgrade",
        help="convert a run written by torchinstruments 0.8.0 into a new directory",
    )
    convert.add_argument("old_dir", help="the 0.8.0 run directory (only read)")
    convert.add_argument("new_dir", help="where the upgraded run goes (new or empty)")
    _progress_flag(convert)
    convert.set_defaults(run=_upgrade, paths=("old_dir",))
    return parser


def _missing_paths(args: argparse.Namespace) -> list[str]:
    missing = []
    for name in args.paths:
        value = getattr(args, name)
        for path in value if isinstance(value, list) else [value]:
            if not os.path.exists(path):
                missing.append(str(path))
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ti`` console script; returns the exit status (:data:`EXIT_CODES`)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and argparse's usage errors (2)
        return exc.code if isinstance(exc.code, int) else USAGE
    prefix = f"ti {args.command}"
    missing = _missing_paths(args)
    if missing:
        print(f"{prefix}: {', '.join(missing)}: no such file or directory", file=sys.stderr)
        return USAGE
    try:
        if args.command == "compare" and len(args.runs) < 2:
            raise UsageError(f"compare two or more runs, got {len(args.runs)}")
        for name in args.paths:
            # consolidate checks for itself, naming how to go on; upgrade wants a 0.8.0 run
            if args.command in _ACTIONS:
                value = getattr(args, name)
                for path in value if isinstance(value, list) else [value]:
                    check_not_legacy(path, _ACTIONS[args.command])
        code = int(args.run(args))
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except UsageError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return USAGE
    except (OSError, ValueError, RuntimeError) as exc:  # LegacyRunError, a failing disk: one line
        print(f"{prefix}: {exc}", file=sys.stderr)
        return REFUSED


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``ti summary DIR | head``): stop quietly, as Unix
    tools do. Python flushes stdout again at exit, so stdout is pointed at the null device
    first; the exit status is the shell's for a command stopped by SIGPIPE (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return PIPE_CLOSED


_ACTIONS = {
    "summary": "summarized",
    "compare": "compared",
    "validate": "validated against the current contract",
}


if __name__ == "__main__":
    sys.exit(main())
