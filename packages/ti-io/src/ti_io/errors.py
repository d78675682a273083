"""Errors raised by ti-io."""

from __future__ import annotations


class ArtifactWriteError(OSError):
    """Writing an artifact failed; names the path and what was lost.

    Raised on the training thread by the next ``write_*`` or ``close`` call after the
    background writer failed (the observer's error policy then decides: ``warn`` warns and
    training continues). Everything published before the failure stays readable.
    """

    def __init__(self, message: str, *, paths: tuple[str, ...] = (), rows_lost: int = 0) -> None:
        super().__init__(message)
        self.paths = paths
        self.rows_lost = rows_lost


class NothingToConsolidateError(FileNotFoundError):
    """``consolidate`` was pointed at a directory that holds no run to finish."""


class FinalizationError(OSError):
    """Finalizing a run (``DirectorySink.close`` or ``consolidate``) stopped before it finished.

    Nothing is lost: the message says where every row still is and names the command that
    finishes the run (``command``; ``ti consolidate DIR``, which resumes from the step the
    finalization journal records). ``state`` is that step as left on disk (``"writing"``,
    ``"written"``), or None when no finalization was recorded as started. ``errno`` is the
    cause's, when it had one.
    """

    def __init__(
        self,
        message: str,
        *,
        directory: str,
        state: str | None,
        command: str | None,
        cause_errno: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = cause_errno
        self.directory = directory
        self.state = state
        self.command = command


class ShrinkRefusedError(FinalizationError):
    """Finalization refused to replace a final file by one with fewer rows, or to retire parts
    that a final file does not hold: a finished history is never replaced by a smaller one."""


class DamagedPartsError(FinalizationError):
    """A part of the run is damaged (truncated, its footer or a page checksum fails): the
    finalization changed nothing. ``command`` is ``ti consolidate --skip-damaged DIR``, which
    moves the damaged parts into ``damaged/`` and consolidates the rest."""


class FinalizationBusyError(RuntimeError):
    """Another process is finalizing the same run directory right now."""
