"""``ti validate DIR``: check every artifact against ti-schema; exit 1 listing mismatches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ti_io.cli.status import OK, REFUSED
from ti_io.finish.journal import interrupted_finalizations
from ti_schema.artifacts import artifact_dir_problems

if TYPE_CHECKING:
    from ti_io.cli.options import Commands


def add_parser(commands: Commands) -> None:
    """Register ``ti validate`` with the subparsers of ``ti``."""
    validate = commands.add_parser(
        "validate", help="check every artifact against ti-schema; exit 1 listing mismatches"
    )
    validate.add_argument("dir", help="a run directory, or a directory of rank-NNN runs")
    validate.set_defaults(
        run=run, paths=("dir",), refuses_legacy="validated against the current contract"
    )


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    try:
        # Live and interrupted runs are checked as they stand: parts, catalog and index.md.
        problems = [str(p) for p in artifact_dir_problems(root, allow_live=True)]
    except NotADirectoryError as exc:
        print(f"ti validate: {exc}", file=sys.stderr)
        return REFUSED
    journal_problems, notes = interrupted_finalizations(root)
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
