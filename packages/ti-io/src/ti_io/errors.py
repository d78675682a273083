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
