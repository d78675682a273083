"""``ti upgrade OLD NEW``: convert a run written by torchinstruments 0.8.0 into a new directory."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ti_io.cli.options import progress_flag
from ti_io.cli.status import OK, REFUSED
from ti_io.finish.upgrade import UpgradeError, upgrade
from ti_io.progress import TerminalProgress

if TYPE_CHECKING:
    from ti_io.cli.options import Commands


def add_parser(commands: Commands) -> None:
    """Register ``ti upgrade`` with the subparsers of ``ti``."""
    convert = commands.add_parser(
        "upgrade",
        help="convert a run written by torchinstruments 0.8.0 into a new directory",
    )
    convert.add_argument("old_dir", help="the 0.8.0 run directory or its URI (only read)")
    convert.add_argument("new_dir", help="where the upgraded run goes (new or empty)")
    progress_flag(convert)
    # a 0.8.0 run is what upgrade wants: no refusal
    convert.set_defaults(run=run, paths=("old_dir",), remote_reads=("old_dir",))


def run(args: argparse.Namespace) -> int:
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
