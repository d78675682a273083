"""The ``ti`` command: ``ti summary``, ``ti compare``, ``ti validate``, ``ti consolidate``,
``ti upgrade`` and ``ti --version``.

One module per command registers its subparser (``add_parser``) and runs it (``run``); the
answer itself is a public function of :mod:`ti_io.read` or :mod:`ti_io.finish`. Every command
first recognizes a run directory written by torchinstruments 0.8.0 and says so in one line
(exit 1), pointing at ``ti upgrade``, instead of failing on its columns. Exit codes follow the
Unix tools (:data:`~ti_io.cli.status.EXIT_CODES`, printed by ``ti --help``). Machine output
(``--csv``, ``--json``) goes to stdout alone; progress bars and notes go to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ti_io.cli import compare, consolidate, summary, upgrade, validate
from ti_io.cli.status import PIPE_CLOSED, REFUSED, USAGE, UsageError, exit_codes_help
from ti_io.cli.version import versions
from ti_io.read.legacy_layout import check_not_legacy

COMMANDS = (summary, compare, validate, consolidate, upgrade)
"""The command modules, in ``ti --help`` order; each has ``add_parser`` and ``run``."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ti``, with every command of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="ti",
        description="Read, compare, check and finish TorchInstruments run directories.",
        epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=versions(),
        help="print the data contract's version and each installed ti package's, then exit",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def _path_arguments(args: argparse.Namespace) -> list[str]:
    paths: list[str] = []
    for name in args.paths:
        value = getattr(args, name)
        paths += value if isinstance(value, list) else [value]
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ti`` console script; returns the exit status
    (:data:`~ti_io.cli.status.EXIT_CODES`)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and argparse's usage errors (2)
        return exc.code if isinstance(exc.code, int) else USAGE
    prefix = f"ti {args.command}"
    missing = [str(path) for path in _path_arguments(args) if not os.path.exists(path)]
    if missing:
        print(f"{prefix}: {', '.join(missing)}: no such file or directory", file=sys.stderr)
        return USAGE
    try:
        check_usage = getattr(args, "check_usage", None)
        if check_usage is not None:
            check_usage(args)
        action = getattr(args, "refuses_legacy", None)
        if action is not None:
            for path in _path_arguments(args):
                check_not_legacy(path, action)
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


__all__ = ["COMMANDS", "build_parser", "main"]
