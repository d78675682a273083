"""The exit status of every ``ti`` command, and the usage error."""

from __future__ import annotations

import textwrap
from typing import Final

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


class UsageError(ValueError):
    """A command line that cannot be run as given (exit 2)."""


def exit_codes_help() -> str:
    """The ``exit status:`` section of ``ti --help``."""
    width = max(len(str(code)) for code, _ in EXIT_CODES)
    lines = ["exit status:"]
    for code, meaning in EXIT_CODES:
        wrapped = textwrap.wrap(meaning, 88 - width - 4)
        lines.append(f"  {code:<{width}}  {wrapped[0]}")
        lines += [" " * (width + 4) + rest for rest in wrapped[1:]]
    return "\n".join(lines)
