"""Progress of long operations (``consolidate``, ``upgrade``), and the ``ti`` command's bar.

The library reports progress through a plain callback, ``progress(done, total)``, called with
the units finished so far (parts for ``consolidate``, history rows for ``upgrade``) and the
units in all; it never prints. The ``ti`` command turns that into a bar on stderr, only when
stderr is a terminal or the user asked for it (``--progress``), so standard output and
anything a script reads stay untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

ProgressCallback = Callable[[int, int], None]
"""``progress(done, total)``: ``done`` of ``total`` units finished; ``done`` only grows. It may
be called from a helper thread of the operation, one call at a time."""

BAR_DELAY_S = 0.5
"""On a terminal a bar appears only once an operation has run this long, so short ones stay
silent; one asked for (``--progress``) shows at once."""


class Steps:
    """Units done towards ``total``, each advance reported to ``progress`` (None: nothing is
    reported). A reader that reads the rows and then aggregates them counts both: its total is
    twice the rows."""

    def __init__(self, progress: ProgressCallback | None, total: int) -> None:
        self._progress = progress
        self.total = max(total, 0)
        self.done = 0

    def advance(self, units: int) -> None:
        self.done = min(self.done + units, self.total)
        if self._progress is not None:
            self._progress(self.done, self.total)


class TerminalProgress:
    """A stderr progress bar fed by :data:`ProgressCallback` calls; a context manager.

    ``enabled=None`` shows it only when ``stream`` is a terminal (after :data:`BAR_DELAY_S`);
    True forces it (``ti ... --progress``), False turns it off. The bar is closed (its line
    cleared) on exit. Calls may come from a helper thread (consolidation reads parts on one).
    """

    def __init__(
        self, description: str, unit: str, *, enabled: bool | None, stream: TextIO | None = None
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        show = enabled if enabled is not None else _is_terminal(self._stream)
        self._description = description
        self._unit = unit
        self._show = show
        self._delay = BAR_DELAY_S if enabled is None else 0.0
        self._bar: Any = None  # a tqdm bar, made on the first report

    def __call__(self, done: int, total: int) -> None:
        if not self._show:
            return
        if self._bar is None:
            from tqdm import tqdm  # the command's bar only: readers and writers never need it

            self._bar = tqdm(
                total=total,
                desc=self._description,
                unit=self._unit,
                unit_scale=self._unit == "rows",
                file=self._stream,
                delay=self._delay,
                leave=False,
                dynamic_ncols=True,
            )
        self._bar.total = total
        self._bar.update(done - self._bar.n)

    def __enter__(self) -> TerminalProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False
