"""``ti report RUN [RUN ...] -o report.html``: the runs as one self-contained HTML page."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ti_io.cli.options import positive, progress_flag
from ti_io.cli.remote import is_uri
from ti_io.cli.status import OK, UsageError
from ti_io.progress import TerminalProgress
from ti_io.read.compare import unique_labels
from ti_schema import SIGNALS

if TYPE_CHECKING:
    from ti_io.cli.options import Commands


def add_parser(commands: Commands) -> None:
    """Register ``ti report`` with the subparsers of ``ti``."""
    report = commands.add_parser(
        "report",
        help="one self-contained HTML page of one or more runs (heat maps, events, ratios)",
        description=(
            "Draw runs as one HTML file that opens offline: a heat map of layers over samples "
            "per signal and metric (the runs side by side on one colour scale), the events on "
            "the time axis, a sparkline and the window means per layer, and with several runs "
            'each layer\'s ratio to the first run. Needs plotly: pip install "ti-io[report]".'
        ),
    )
    report.add_argument(
        "runs", nargs="+", metavar="RUN", help="run directories or URIs (live runs too)"
    )
    report.add_argument(
        "-o",
        "--output",
        default="report.html",
        metavar="FILE.html",
        help="where to write the page (default: report.html)",
    )
    report.add_argument(
        "--layer", action="append", metavar="GLOB", help="only layers matching this glob"
    )
    report.add_argument(
        "--signal",
        action="append",
        choices=SIGNALS,
        help="draw this signal (repeatable; default: output and output_gradient)",
    )
    report.add_argument(
        "--metric",
        action="append",
        help="draw this metric (repeatable; default: std, and nonfinite_fraction where not 0)",
    )
    report.add_argument(
        "--columns",
        type=positive,
        default=None,
        help="columns of samples per heat map, at most (default: 400, fewer on wide runs)",
    )
    progress_flag(report)
    report.set_defaults(
        run=run,
        paths=("runs",),
        refuses_legacy="reported",
        check_usage=check_usage,
        remote_reads=("runs",),
    )


def check_usage(args: argparse.Namespace) -> None:
    """Keep the runs as given (a URI is replaced by a local copy before :func:`run`), and
    refuse an output that is not an ``.html`` file in an existing directory."""
    args.given = list(args.runs)
    output = Path(args.output)
    if output.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--output {args.output}: the report is an HTML file; name it *.html")
    if output.is_dir() or not output.parent.is_dir():
        raise UsageError(f"--output {args.output}: not a file in an existing directory")


def _labels(given: list[str]) -> list[str]:
    """Run labels as ``ti compare`` makes them, a URI's path counting as its parts."""
    return unique_labels(
        [
            PurePosixPath(g.split("://", 1)[1]).parts if is_uri(g) else Path(g).resolve().parts
            for g in given
        ]
    )


def run(args: argparse.Namespace) -> int:
    try:
        from ti_io.report import DEFAULT_COLUMNS, write_report
    except ImportError as exc:
        raise RuntimeError(str(exc)) from exc
    given = getattr(args, "given", list(args.runs))
    labels = _labels(given)
    if len(set(labels)) != len(labels):
        raise UsageError(f"a run is given twice: {' '.join(given)}")
    with TerminalProgress("report", "rows", enabled=args.progress) as progress:
        written = write_report(
            dict(zip(labels, args.runs, strict=True)),
            args.output,
            signals=args.signal,
            metrics=args.metric,
            layers=args.layer,
            columns=args.columns or DEFAULT_COLUMNS,
            progress=progress,
            locations=given,
        )
    size = written.stat().st_size
    print(f"report: {written} ({size / 1e6:.1f} MB)", file=sys.stdout)
    return OK
