"""The ``ti`` command: ``ti summary``, ``ti compare``, ``ti report``, ``ti validate``,
``ti consolidate``, ``ti upgrade``, ``ti --version``, and the commands other packages add
(``ti drift``, ti-dist's).

One module per command registers its subparser (``add_parser``) and runs it (``run``); the
answer itself is a public function of :mod:`ti_io.read` or :mod:`ti_io.finish`. Every command
first recognizes a run directory written by torchinstruments 0.8.0 and says so in one line
(exit 1), pointing at ``ti upgrade``, instead of failing on its columns. Exit codes follow the
Unix tools (:data:`~ti_io.cli.status.EXIT_CODES`, printed by ``ti --help``). Machine output
(``--csv``, ``--json``) goes to stdout alone; progress bars and notes go to stderr.

Another package adds a command through the ``ti.commands`` entry-point group: each entry point,
named as the command, names a module with the same ``add_parser`` and ``run`` (ti-io imports no
such package itself).
A command of :data:`PLUGIN_PACKAGES` whose package is not installed says which one to install.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import PurePosixPath
from types import ModuleType
from typing import Final

from ti_io.cli import compare, consolidate, report, summary, upgrade, validate
from ti_io.cli.remote import is_uri, remote_reads
from ti_io.cli.status import PIPE_CLOSED, REFUSED, USAGE, UsageError, exit_codes_help
from ti_io.cli.version import versions
from ti_io.read.legacy_layout import check_not_legacy

COMMANDS = (summary, compare, report, validate, consolidate, upgrade)
"""The command modules, in ``ti --help`` order; each has ``add_parser`` and ``run``."""

COMMANDS_GROUP: Final[str] = "ti.commands"
"""The entry-point group of the commands other packages add (a module with ``add_parser`` and
``run`` each)."""

PLUGIN_PACKAGES: Final[dict[str, str]] = {"drift": "ti-dist", "shards": "ti-dist"}
"""The commands other TorchInstruments packages add, and the package that adds each."""


def plugin_commands() -> tuple[dict[str, ModuleType], dict[str, str]]:
    """The command modules of the ``ti.commands`` entry points by command name (in name order),
    and why those that failed to load did (one bad package never breaks ``ti``)."""
    modules: dict[str, ModuleType] = {}
    failed: dict[str, str] = {}
    for entry in sorted(metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            module = entry.load()
        except Exception as exc:  # an installed package that cannot be imported
            failed[entry.name] = f"{type(exc).__name__}: {exc}"
            continue
        if not all(callable(getattr(module, name, None)) for name in ("add_parser", "run")):
            failed[entry.name] = f"{entry.value} has no add_parser and run"
            continue
        modules[entry.name] = module
    return modules, failed


def missing_command(
    argv: Sequence[str], registered: Sequence[str], failed: dict[str, str]
) -> str | None:
    """Why the command ``argv`` names cannot run when it is one of :data:`PLUGIN_PACKAGES` and
    not in ``registered`` (its package is not installed, or failed to load); else None."""
    name = next((arg for arg in argv if not arg.startswith("-")), None)
    if name is None or name not in PLUGIN_PACKAGES or name in registered:
        return None
    package = PLUGIN_PACKAGES[name]
    if name in failed:
        return f"ti {name}: {package} is installed but its command failed to load: {failed[name]}"
    return f"ti {name}: this command comes with {package}; install it: pip install {package}"


def build_parser(plugins: Sequence[ModuleType] | None = None) -> argparse.ArgumentParser:
    """The parser of ``ti``, with every command of :data:`COMMANDS`, then ``plugins`` (None:
    those of :func:`plugin_commands`)."""
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
    added = plugin_commands()[0].values() if plugins is None else plugins
    for command in (*COMMANDS, *added):
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
    plugins, failed = plugin_commands()
    arguments = sys.argv[1:] if argv is None else list(argv)
    missing = missing_command(arguments, list(plugins), failed)
    if missing is not None:
        print(missing, file=sys.stderr)
        return USAGE
    try:
        args = build_parser(list(plugins.values())).parse_args(arguments)
    except SystemExit as exc:  # --help, --version (0) and argparse's usage errors (2)
        return exc.code if isinstance(exc.code, int) else USAGE
    prefix = f"ti {args.command}"
    # A URI (s3://bucket/run) is looked up by the command itself (ti_io.cli.remote).
    absent = [
        str(path)
        for path in _path_arguments(args)
        if not is_uri(str(path)) and not os.path.exists(path)
    ]
    if absent:
        print(f"{prefix}: {', '.join(absent)}: no such file or directory", file=sys.stderr)
        return USAGE
    try:
        check_usage = getattr(args, "check_usage", None)
        if check_usage is not None:
            check_usage(args)
        action = getattr(args, "refuses_legacy", None)
        with remote_reads(args):  # runs on object storage: read-only local copies
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
        print(f"{prefix}: {exc}{_way_forward(exc)}", file=sys.stderr)
        return REFUSED


def _way_forward(exc: BaseException) -> str:
    """What to do about a damaged file (nothing for other errors)."""
    from ti_io.integrity import DamagedFileError
    from ti_schema.layout import part_index

    if not isinstance(exc, DamagedFileError):
        return ""
    path = PurePosixPath(str(exc.path))
    if part_index(path.name) is not None:
        return (
            f"; `ti consolidate --skip-damaged {path.parent.parent}` sets the damaged part "
            "aside (kept in damaged/) and finishes the run from the rest"
        )
    return "; restore it from a copy of the run (`ti validate` lists every damaged file)"


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``ti summary DIR | head``): stop quietly, as Unix
    tools do. Python flushes stdout again at exit, so stdout is pointed at the null device
    first; the exit status is the shell's for a command stopped by SIGPIPE (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return PIPE_CLOSED


__all__ = [
    "COMMANDS",
    "COMMANDS_GROUP",
    "PLUGIN_PACKAGES",
    "build_parser",
    "main",
    "missing_command",
    "plugin_commands",
]
