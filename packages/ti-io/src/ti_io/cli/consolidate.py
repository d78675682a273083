"""``ti consolidate DIR``: finish an interrupted run from its parts (what removal does)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ti_io.cli.options import positive, progress_flag
from ti_io.cli.status import OK, REFUSED
from ti_io.config import HistoryConfig
from ti_io.damaged import gap_lines
from ti_io.errors import FinalizationError, NothingToConsolidateError
from ti_io.finish.consolidate import consolidate
from ti_io.progress import TerminalProgress

if TYPE_CHECKING:
    from ti_io.cli.options import Commands


def add_parser(commands: Commands) -> None:
    """Register ``ti consolidate`` with the subparsers of ``ti``."""
    finish = commands.add_parser(
        "consolidate", help="finish an interrupted run from its parts (what removal does)"
    )
    finish.add_argument("dir", help="the run directory holding history.parts/")
    finish.add_argument(
        "--window", type=positive, default=None, help="result.json window (default: the run's)"
    )
    finish.add_argument(
        "--force",
        action="store_true",
        help="consolidate even if the process that wrote the run seems alive",
    )
    finish.add_argument(
        "--skip-damaged",
        action="store_true",
        help="move damaged parts into DIR/damaged/ (kept) and consolidate the rest; the gap "
        "is recorded in index.md and `ti summary`",
    )
    progress_flag(finish)
    # consolidate recognizes a 0.8.0 run itself, naming how to go on
    finish.set_defaults(run=run, paths=("dir",))


def run(args: argparse.Namespace) -> int:
    config = HistoryConfig(window=args.window) if args.window is not None else None
    try:
        with TerminalProgress("consolidating", "parts", enabled=args.progress) as progress:
            done = consolidate(
                args.dir,
                history_config=config,
                force=args.force,
                progress=progress,
                skip_damaged=args.skip_damaged,
            )
    except (NothingToConsolidateError, RuntimeError, FinalizationError) as exc:
        print(f"ti consolidate: {exc}", file=sys.stderr)
        return REFUSED
    for line in gap_lines(done.skipped):
        print(f"warning: {line}", file=sys.stderr)
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
