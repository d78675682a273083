"""``ti validate DIR``: find every damaged file and every mismatch with ti-schema; exit 1 listing
them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ti_io.cli.options import progress_flag
from ti_io.cli.status import OK, REFUSED
from ti_io.finish.validation import validate_run
from ti_io.progress import TerminalProgress

if TYPE_CHECKING:
    from ti_io.cli.options import Commands


def add_parser(commands: Commands) -> None:
    """Register ``ti validate`` with the subparsers of ``ti``."""
    validate = commands.add_parser(
        "validate",
        help="verify every Parquet file (page checksums) and check every artifact against "
        "ti-schema; exit 1 listing damaged files and mismatches",
    )
    validate.add_argument(
        "dir", help="a run directory, or a directory of rank-NNN runs (or its URI: s3://...)"
    )
    progress_flag(validate)
    validate.set_defaults(
        run=run,
        paths=("dir",),
        refuses_legacy="validated against the current contract",
        remote_reads=("dir",),
    )


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    try:
        # Live and interrupted runs are checked as they stand: parts, catalog and index.md.
        with TerminalProgress("validate", "rows", enabled=args.progress) as progress:
            found = validate_run(root, progress=progress)
    except NotADirectoryError as exc:
        print(f"ti validate: {exc}", file=sys.stderr)
        return REFUSED
    for note in found.notes:
        print(f"note: {note}", file=sys.stderr)
    if found.problems:
        print(f"{root}: {len(found.problems)} problem(s)")
        for problem in found.problems:
            print(f"  - {problem}")
        return REFUSED
    print("ok")
    return OK
