"""Command-line options and value types several ``ti`` commands share."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]
    """The subparsers of ``ti``, with which each command registers itself."""


def machine_output(parser: argparse.ArgumentParser) -> None:
    """``--csv`` / ``--json`` (``args.format``): the table for machines, on stdout alone."""
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


def progress_flag(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (``args.progress``; None: only on a terminal)."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )


def sample_id(text: str) -> int:
    """A sample id argument (an int >= 0)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a sample id (an int >= 0), got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a sample id (an int >= 0), got {value}")
    return value


def positive(text: str) -> int:
    """A count argument (an int >= 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value
