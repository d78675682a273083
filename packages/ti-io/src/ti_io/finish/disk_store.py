"""Finalizing a run in a local directory: the disk's side of :class:`~ti_io.finish.run_store.
RunStore`.

Every file is published by temporary file, fsync, rename and fsync of the directory
(:mod:`ti_io.publishing`), so a kill leaves each file whole or absent. Parts are read where they
are (the workspace is the run directory) and retired by renaming each parts directory away at
once, then emptying it. One finalizer at a time: an exclusive ``flock`` on the directory,
released by the kernel however the process ends (where locks are unsupported, it goes on
without). A run an earlier ti-io finalized before journals existed, interrupted between its two
retirements, is recognized here (:meth:`DiskStore.finished_before_journals`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from ti_io.damaged import SkippedPart, find_damaged_parts, read_skipped, set_aside
from ti_io.errors import FinalizationBusyError, ShrinkRefusedError
from ti_io.finish.journal import FinalizationState, Journal, read_journal
from ti_io.finish.run_store import FinishedRun, StoreWords, damaged_final
from ti_io.integrity import DamagedFileError, parquet_rows, verify_parquet
from ti_io.publishing import fsync_dir, publish_text, remove_stale_temporaries, temp_path
from ti_io.read.legacy_layout import check_not_legacy
from ti_schema.layout import (
    EVENT_PARTS,
    HISTOGRAM_PARTS,
    HISTOGRAMS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    JOURNAL_FILE,
    RUN_FILE,
    list_parts,
    list_rank_dirs,
)

_WORDS = StoreWords(unit="directory", parts_in="in", retiring="retiring")


class DiskStore:
    """The run in the local directory ``directory``."""

    copies_parts = False
    shown = None
    words = _WORDS

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def where(self) -> Path:
        return self.directory

    def still_there(self) -> bool:
        return self.directory.is_dir()

    def refuse_legacy(self) -> None:
        check_not_legacy(self.directory, "consolidated")

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # no flock here (Windows): one finalizer at a time is up to the user
            yield
            return
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FinalizationBusyError(self._busy()) from None
            except OSError:
                pass  # locks unsupported (some network file systems): go on without
            yield
        finally:
            os.close(fd)  # releases the lock

    def _busy(self) -> str:
        try:
            journal = read_journal(self.directory)
        except (OSError, ValueError):
            journal = None
        who = (
            f"process {journal.pid} on {journal.host}" if journal is not None else "another process"
        )
        return (
            f"{self.directory} is being finalized right now by {who}, which holds its "
            "finalization lock; wait until it ends (then `ti consolidate` says it is already "
            "consolidated, or resumes what that process left)"
        )

    def read_journal(self) -> Journal | None:
        return read_journal(self.directory)

    def publish_journal(self, journal: Journal) -> None:
        publish_text(self.directory / JOURNAL_FILE, journal.to_json())

    def remove_journal(self) -> None:
        os.remove(self.directory / JOURNAL_FILE)
        fsync_dir(self.directory)

    @contextlib.contextmanager
    def workspace(self) -> Iterator[Path]:
        yield self.directory  # the parts are read, and the final files written, in place

    def set_damaged_aside(self, work: Path) -> None:
        set_aside(work, find_damaged_parts(work))

    def finished_before_journals(self) -> Journal | None:
        """history.parquet is there and ``history.parts/`` is gone: that ti-io published all
        four final files before retiring either parts directory, so nothing is rewritten."""
        directory = self.directory
        if (directory / HISTORY_PARTS).exists() or not (directory / HISTORY_FILE).is_file():
            return None
        histograms = directory / HISTOGRAMS_FILE
        waiting = self.waiting_rows(HISTOGRAM_PARTS)
        if not histograms.is_file():
            raise self._refusal(
                f"{HISTORY_FILE} is finished and {HISTORY_PARTS}/ retired, but "
                f"{HISTOGRAMS_FILE} is missing, so it is not known whether {HISTOGRAM_PARTS}/ "
                "is already in a final file; nothing was changed"
            )
        held = parquet_rows(histograms)
        if held < waiting:
            raise self._refusal(
                f"{HISTOGRAMS_FILE} holds {held} rows but {HISTOGRAM_PARTS}/ holds {waiting}; "
                "retiring the parts would lose rows, and rebuilding the final files is "
                f"impossible without {HISTORY_PARTS}/; nothing was changed"
            )
        return Journal(
            FinalizationState.WRITTEN,
            os.getpid(),
            socket.gethostname(),
            parquet_rows(directory / HISTORY_FILE),
            held,
        )

    def _refusal(self, why: str) -> ShrinkRefusedError:
        return ShrinkRefusedError(
            f"refusing to finalize {self.directory}: {why}.",
            directory=str(self.directory),
            state=None,
            command=None,
        )

    def remove_stale_temporaries(self) -> None:
        remove_stale_temporaries(self.directory)

    def publish_final_files(self, work: Path) -> None:
        pass  # written in place, each published atomically as it was written

    def final_rows(self, name: str) -> int | None:
        path = self.directory / name
        return parquet_rows(path) if path.is_file() else None

    def waiting_rows(self, parts_dir: str) -> int:
        return sum(parquet_rows(p) for p in list_parts(self.directory / parts_dir))

    def has_file(self, name: str) -> bool:
        return (self.directory / name).is_file()

    def has_parts(self, *parts_dirs: str) -> bool:
        return any((self.directory / name).is_dir() for name in parts_dirs)

    def retire_parts(self) -> None:
        """Rename each parts directory away at once (a reader or a crash never sees a
        half-emptied ``*.parts/``), then remove them and any retired earlier."""
        retired = False
        for name in (HISTORY_PARTS, HISTOGRAM_PARTS, EVENT_PARTS):
            path = self.directory / name
            if path.is_dir():
                os.replace(path, temp_path(path))
                retired = True
        if retired:
            fsync_dir(self.directory)
        remove_stale_temporaries(self.directory)

    def recorded_skipped(self) -> tuple[SkippedPart, ...]:
        return read_skipped(self.directory)

    def finished(self) -> FinishedRun | None:
        """Its final files verified (every page), their rows."""
        finals = [self.directory / HISTORY_FILE, self.directory / HISTOGRAMS_FILE]
        if not finals[0].is_file():
            return None
        try:
            for final in finals:
                if final.is_file():
                    verify_parquet(final)
        except DamagedFileError as exc:
            raise damaged_final(self.directory, exc) from None
        return FinishedRun(
            parquet_rows(finals[0]),
            parquet_rows(finals[1]) if finals[1].is_file() else 0,
            read_skipped(self.directory),
        )

    def rank_names(self) -> list[str]:
        return [child.name for _, child in list_rank_dirs(self.directory)]

    def run_facts_text(self) -> str | None:
        try:
            data = (self.directory / HISTORY_PARTS / RUN_FILE).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return data.decode("utf-8", errors="replace")

    def damaged_name(self, path: Path | str) -> tuple[str, bool]:
        return str(path), Path(path).parent.name.endswith(".parts")
