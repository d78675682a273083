"""The finalization journal: finalizing a run as a state machine that resumes from any point.

Finalizing (``DirectorySink.close``, ``ti consolidate``) turns a run's parts into its final
files and then retires the parts. The process may be killed at any instruction and any file
operation may fail, so the last step completed is recorded in the journal
(``finalization.json``, ``ti_schema.layout.JOURNAL_FILE``) before the next step starts, and
every step may be run again: the next finalization resumes where the last one stopped. This
module is the one definition of the states and their transitions::

    live or interrupted  --(1) start-->  WRITING  --(2) files written-->  WRITTEN
        --(3) parts retired, journal removed-->  finalized

======================  =========================================================================
state (on disk)         what holds, and what a resumed finalization does
======================  =========================================================================
live or interrupted     no journal; ``history.parts/`` and ``histograms.parts/`` hold every row
                        published. (1) publishes the journal ``writing``.
``writing``             the parts are still the source of truth. history.parquet,
                        histograms.parquet, result.json and index.md are each absent or complete
                        (published atomically), possibly from an earlier attempt. Resumed: all
                        four are written again from the parts (the same rows); none may shrink
                        (:class:`~ti_io.errors.ShrinkRefusedError`). (2) publishes ``written``
                        with the rows of both Parquet files.
``written``             the four files are complete; the journal holds their row counts. The
                        parts are being retired (each parts directory renamed away, then
                        emptied). Resumed: the final files must still hold the recorded rows;
                        then what is left of the parts is retired and (3) removes the journal.
finalized               no journal, no parts: the final files are the run.
======================  =========================================================================

``events.parquet`` is written from ``events.parts/`` in ``writing`` with the other files
(before result.json and index.md, which list the events); in ``written`` it must hold every row
of the event parts left, and ``events.parts/`` is retired with the others.

Damaged parts (:mod:`ti_io.integrity`): a part whose footer or pages fail verification stops
the finalization with :class:`~ti_io.errors.DamagedPartsError` naming ``--skip-damaged``; a
journal this finalization published is removed first, so the run is left as it was found. With
``--skip-damaged`` the damaged parts are set aside (:mod:`ti_io.damaged`: recorded, then moved
into ``damaged/``) under the lock, while the parts are the source of truth (no journal, or
``writing``), before anything is counted or written.

Every transition is published as the other files are (temporary file, fsync, rename, fsync of
the directory), after the work of its step is durable. Parts are retired only in ``written``,
so a history is never rebuilt from fewer parts than it was written from, and a final Parquet
file is never replaced by one with fewer rows. A run finalized by an earlier ti-io (no journal)
and interrupted between retiring ``history.parts/`` and ``histograms.parts/`` is recognized
(history.parquet present, ``history.parts/`` gone: every final file was written before either
retirement) and finished by retiring the rest, never rebuilt.

One finalizer at a time: it holds an exclusive ``flock`` on the run directory (released by the
kernel however the process ends); where locks are unsupported it goes on without. While it
holds the lock it removes temporaries that interrupted writes left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from ti_io.errors import (
    DamagedPartsError,
    FinalizationBusyError,
    FinalizationError,
    ShrinkRefusedError,
)
from ti_io.integrity import DamagedFileError, parquet_rows
from ti_io.publishing import fsync_dir, publish_text, remove_stale_temporaries, temp_path
from ti_io.storage import RunLocation
from ti_schema.layout import (
    EVENT_PARTS,
    EVENTS_FILE,
    HISTOGRAM_PARTS,
    HISTOGRAMS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    INDEX_FILE,
    JOURNAL_FILE,
    RESULT_FILE,
    list_parts,
    list_rank_dirs,
)

JOURNAL_FORMAT: Final[str] = "ti.finalization"
"""The ``format`` key of every journal."""
JOURNAL_VERSION: Final[int] = 1

_PAIRS: Final[tuple[tuple[str, str], ...]] = (
    (HISTORY_FILE, HISTORY_PARTS),
    (HISTOGRAMS_FILE, HISTOGRAM_PARTS),
    (EVENTS_FILE, EVENT_PARTS),
)
"""Each final Parquet file and the parts it is written from."""


class FinalizationState(StrEnum):
    """The step a finalization has completed, as its journal records it (module docstring)."""

    WRITING = "writing"
    """Started: the parts are the source of truth; the final files are being written."""
    WRITTEN = "written"
    """The final files are complete; the parts are being retired."""


@dataclass(frozen=True)
class Journal:
    """The content of ``finalization.json``."""

    state: FinalizationState
    pid: int
    """The process finalizing (informational: the lock says whether one is at work)."""
    host: str
    history_rows: int | None = None
    """Rows of history.parquet, once ``written``."""
    histogram_rows: int | None = None
    """Rows of histograms.parquet, once ``written``."""

    def to_json(self) -> str:
        doc = {
            "format": JOURNAL_FORMAT,
            "version": JOURNAL_VERSION,
            "state": self.state.value,
            "pid": self.pid,
            "host": self.host,
            "history_rows": self.history_rows,
            "histogram_rows": self.histogram_rows,
        }
        return json.dumps(doc, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, path: Path | RunLocation) -> Journal:
        """Parse a journal; ValueError naming ``path`` and the problem when it is not one."""
        try:
            doc: Any = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path} is not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != JOURNAL_FORMAT:
            raise ValueError(f"{path} is not a finalization journal (no format {JOURNAL_FORMAT!r})")
        if doc.get("version") != JOURNAL_VERSION:
            raise ValueError(
                f"{path} is a journal of version {doc.get('version')!r}; this ti-io reads "
                f"version {JOURNAL_VERSION} (upgrade ti-io)"
            )
        try:
            state = FinalizationState(str(doc.get("state")))
        except ValueError:
            known = ", ".join(s.value for s in FinalizationState)
            raise ValueError(
                f"{path} has the unknown state {doc.get('state')!r} (known: {known})"
            ) from None
        rows = {key: doc.get(key) for key in ("history_rows", "histogram_rows")}
        for key, value in rows.items():
            bad = value is not None and (isinstance(value, bool) or not isinstance(value, int))
            if bad or (state is FinalizationState.WRITTEN and value is None):
                raise ValueError(f"{path}: {key} must be a row count, got {value!r}")
        pid, host = doc.get("pid"), doc.get("host")
        return cls(
            state=state,
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else -1,
            host=host if isinstance(host, str) else "",
            history_rows=rows["history_rows"],
            histogram_rows=rows["histogram_rows"],
        )


def read_journal(directory: Path) -> Journal | None:
    """The journal of the run in ``directory``, or None when there is none (no finalization
    started, or it finished). Raises ValueError for a file that is not a journal of this
    version, OSError when it cannot be read."""
    path = directory / JOURNAL_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return Journal.from_json(text, path)


def interrupted_finalizations(root: Path) -> tuple[list[str], list[str]]:
    """The journals of ``root`` (or of its ``rank-NNN`` runs): problems with those that cannot
    be read, and a note for each run whose finalization was interrupted (how to finish it)."""
    problems: list[str] = []
    notes: list[str] = []
    runs = [child for _, child in list_rank_dirs(root)] or [root]
    for run in runs:
        try:
            journal = read_journal(run)
        except (OSError, ValueError) as exc:
            problems.append(f"{run / JOURNAL_FILE}: {exc}")
            continue
        if journal is not None:
            notes.append(
                f"{run}: its finalization was interrupted after the step {journal.state.value!r} "
                f"({JOURNAL_FILE}); `ti consolidate {run}` finishes it"
            )
    return problems, notes


@dataclass(frozen=True)
class Finalized:
    """What :func:`finalize_run` did."""

    history_rows: int
    histogram_rows: int
    parts: int
    """Parts written into the final files (0 when it only finished a retirement)."""
    resumed_from: FinalizationState | None
    """The state a journal recorded when this finalization began, or None (a fresh start)."""


WriteFiles = Callable[[], tuple[int, int]]
"""Writes history.parquet, histograms.parquet, result.json and index.md from the parts (each
published atomically); returns the rows of the two Parquet files."""


@dataclass(frozen=True)
class Resumption:
    """How to resume in a later process: what the error message tells the user to run."""

    force: bool = False
    """``--force``: the run's writer (this process) is alive; needed only while no journal
    exists, since ``consolidate`` skips the live-writer check once one does."""
    window: int | None = None
    """``--window N`` given to this finalization, repeated so a resumption writes the same."""
    skip_damaged: bool = False
    """``--skip-damaged``: damaged parts were set aside (``damaged/``) by this finalization."""

    def command(self, directory: Path | RunLocation, journal: Journal | None) -> str:
        words = ["ti", "consolidate"]
        if self.force and journal is None:
            words.append("--force")
        if self.skip_damaged:
            words.append("--skip-damaged")
        if self.window is not None:
            words += ["--window", str(self.window)]
        return shlex.join([*words, str(directory)])


def finalize_run(
    directory: Path,
    write_files: WriteFiles,
    resumption: Resumption,
    before_writing: Callable[[], None] | None = None,
) -> Finalized:
    """Finalize the run in ``directory`` from whatever state it is in (module docstring).

    ``before_writing``: run under the finalization lock while the parts are still the source
    of truth (no journal, or ``writing``), before they are counted (``--skip-damaged`` sets
    damaged parts aside there).

    Raises FinalizationBusyError when another process holds the run's finalization lock,
    ShrinkRefusedError when a finished file would shrink or a retirement would lose rows, and
    FinalizationError (saying what is safe and which command finishes the run) for any other
    failure.
    """
    finalization = _Finalization(directory)
    try:
        with _exclusive(directory):
            return finalization.run(write_files, before_writing)
    except (FinalizationError, FinalizationBusyError):
        raise
    except Exception as exc:  # every other failure: say where things stand, how to go on
        raise stopped(directory, finalization.doing, exc, resumption) from exc


class _Finalization:
    """One finalization: runs the transitions in order; ``doing`` names the current step."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.doing = "taking the finalization lock"

    def run(
        self, write_files: WriteFiles, before_writing: Callable[[], None] | None = None
    ) -> Finalized:
        directory = self.directory
        self.doing = f"reading the finalization journal ({JOURNAL_FILE})"
        journal = read_journal(directory)
        resumed_from = journal.state if journal is not None else None
        parts = 0
        if before_writing is not None and (
            journal is None or journal.state is FinalizationState.WRITING
        ):
            self.doing = "verifying the parts and setting the damaged ones aside (damaged/)"
            before_writing()
        if journal is None:
            self.doing = "checking for a finalization an earlier ti-io left unfinished"
            journal = _finished_before_journals(directory)
            if journal is None:
                self.doing = "checking that no finished file would shrink"
                parts = _refuse_to_shrink(directory)  # before anything is changed
                self.doing = f"starting the finalization ({JOURNAL_FILE})"
                journal = _publish(directory, FinalizationState.WRITING)
            else:
                resumed_from = journal.state
                self.doing = f"recording the finished files ({JOURNAL_FILE})"
                _publish(directory, journal.state, journal.history_rows, journal.histogram_rows)
        elif journal.state is FinalizationState.WRITING:
            self.doing = "checking that no finished file would shrink"
            parts = _refuse_to_shrink(directory)
        self.doing = "removing temporaries of interrupted writes"
        remove_stale_temporaries(directory)
        if journal.state is FinalizationState.WRITING:
            self.doing = (
                f"writing {HISTORY_FILE}, {HISTOGRAMS_FILE}, {RESULT_FILE} and {INDEX_FILE}"
            )
            try:
                history_rows, histogram_rows = write_files()
            except DamagedFileError:
                if resumed_from is None:  # this finalization started it: leave the run as found
                    os.remove(directory / JOURNAL_FILE)
                    fsync_dir(directory)
                raise
            self.doing = f"recording that the final files are written ({JOURNAL_FILE})"
            journal = _publish(directory, FinalizationState.WRITTEN, history_rows, histogram_rows)
        self.doing = "checking the final files before retiring the parts"
        history_rows, histogram_rows = _check_written(directory, journal)
        self.doing = f"retiring {HISTORY_PARTS}/ and {HISTOGRAM_PARTS}/"
        _retire_parts(directory)
        self.doing = f"removing {JOURNAL_FILE}"
        os.remove(directory / JOURNAL_FILE)
        fsync_dir(directory)
        return Finalized(history_rows, histogram_rows, parts, resumed_from)


def _publish(
    directory: Path,
    state: FinalizationState,
    history_rows: int | None = None,
    histogram_rows: int | None = None,
) -> Journal:
    journal = Journal(state, os.getpid(), socket.gethostname(), history_rows, histogram_rows)
    publish_text(directory / JOURNAL_FILE, journal.to_json())
    return journal


def _rows(path: Path) -> int:
    return parquet_rows(path)  # DamagedFileError naming the file when its footer is damaged


def _finished_before_journals(directory: Path) -> Journal | None:
    """A run that an earlier ti-io (before journals) finished writing and was retiring when it
    stopped: history.parquet is there and ``history.parts/`` is gone. That ti-io published all
    four final files before retiring either parts directory, so nothing is rewritten: the
    state is ``written``, with the rows of the files. None for any other run."""
    if (directory / HISTORY_PARTS).exists() or not (directory / HISTORY_FILE).is_file():
        return None
    histograms = directory / HISTOGRAMS_FILE
    waiting = sum(_rows(p) for p in list_parts(directory / HISTOGRAM_PARTS))
    if not histograms.is_file():
        raise _refusal(
            directory,
            f"{HISTORY_FILE} is finished and {HISTORY_PARTS}/ retired, but {HISTOGRAMS_FILE} is "
            f"missing, so it is not known whether {HISTOGRAM_PARTS}/ is already in a final "
            "file; nothing was changed",
        )
    held = _rows(histograms)
    if held < waiting:
        raise _refusal(
            directory,
            f"{HISTOGRAMS_FILE} holds {held} rows but {HISTOGRAM_PARTS}/ holds {waiting}; "
            "retiring the parts would lose rows, and rebuilding the final files is impossible "
            f"without {HISTORY_PARTS}/; nothing was changed",
        )
    return Journal(
        FinalizationState.WRITTEN,
        os.getpid(),
        socket.gethostname(),
        _rows(directory / HISTORY_FILE),
        held,
    )


def _refuse_to_shrink(directory: Path) -> int:
    """Raise ShrinkRefusedError when a final Parquet file already holds more rows than the
    parts it would be rewritten from; returns the number of parts."""
    parts = 0
    for final_name, parts_name in _PAIRS:
        found = list_parts(directory / parts_name)
        parts += len(found)
        final = directory / final_name
        if not final.is_file():
            continue
        try:
            kept = _rows(final)
        except DamagedFileError:
            continue  # not a whole Parquet file: nothing finished to keep; rewritten from parts
        available = sum(_rows(p) for p in found)
        if available < kept:
            raise _refusal(
                directory,
                f"{final_name} holds {kept} rows and {parts_name}/ only {available}: a finished "
                f"file is never replaced by a smaller one. If {final_name} is the run's, "
                f"{parts_name}/ lost parts after it was written; to rebuild from the parts "
                f"anyway, move {final_name} aside first",
            )
    return parts


def _check_written(directory: Path, journal: Journal) -> tuple[int, int]:
    """Before parts are retired: the final files are there and hold the rows written; returns
    those rows (history, histograms)."""
    held_rows = []
    for name, rows in (
        (HISTORY_FILE, journal.history_rows),
        (HISTOGRAMS_FILE, journal.histogram_rows),
    ):
        path = directory / name
        held = _rows(path) if path.is_file() else None
        if held is None or held != rows:
            raise _refusal(
                directory,
                f"the finalization wrote {rows} rows to {name}, which now "
                f"{'holds ' + str(held) + ' rows' if held is not None else 'is missing'}; "
                f"the parts that remain are kept ({JOURNAL_FILE} records the step)",
            )
        held_rows.append(held)
    events_held = sum(_rows(p) for p in list_parts(directory / EVENT_PARTS))
    if events_held:
        # events.parquet is written with the other files (``writing``); the journal of an
        # earlier ti-io has no count for it, so its parts left must all be in it.
        path = directory / EVENTS_FILE
        held = _rows(path) if path.is_file() else None
        if held is None or held < events_held:
            raise _refusal(
                directory,
                f"{EVENT_PARTS}/ holds {events_held} event rows, which {EVENTS_FILE} "
                f"{'holds only ' + str(held) + ' of' if held is not None else 'is missing for'}; "
                f"the parts that remain are kept ({JOURNAL_FILE} records the step)",
            )
    for name in (RESULT_FILE, INDEX_FILE):
        if not (directory / name).is_file():
            raise _refusal(
                directory,
                f"the finalization wrote {name}, which is now missing; the parts that remain "
                "are kept",
            )
    return held_rows[0], held_rows[1]


def _retire_parts(directory: Path) -> None:
    """Rename each parts directory away at once (a reader or a crash never sees a half-emptied
    ``*.parts/``), then remove them and any retired earlier."""
    retired = False
    for name in (HISTORY_PARTS, HISTOGRAM_PARTS, EVENT_PARTS):
        path = directory / name
        if path.is_dir():
            os.replace(path, temp_path(path))
            retired = True
    if retired:
        fsync_dir(directory)
    remove_stale_temporaries(directory)


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Hold the run's finalization lock: an exclusive ``flock`` on the directory."""
    try:
        import fcntl
    except ImportError:  # no flock here (Windows): one finalizer at a time is up to the user
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FinalizationBusyError(_busy(directory)) from None
        except OSError:
            pass  # locks unsupported (some network file systems): go on without
        yield
    finally:
        os.close(fd)  # releases the lock


def _busy(directory: Path) -> str:
    try:
        journal = read_journal(directory)
    except (OSError, ValueError):
        journal = None
    who = f"process {journal.pid} on {journal.host}" if journal is not None else "another process"
    return (
        f"{directory} is being finalized right now by {who}, which holds its finalization "
        "lock; wait until it ends (then `ti consolidate` says it is already consolidated, or "
        "resumes what that process left)"
    )


def _journal_or_none(directory: Path) -> tuple[Journal | None, bool]:
    """The journal on disk after a failure, and whether it could be read at all."""
    try:
        return read_journal(directory), True
    except (OSError, ValueError):
        return None, False


def _refusal(directory: Path, why: str) -> ShrinkRefusedError:
    journal, _ = _journal_or_none(directory)
    return ShrinkRefusedError(
        f"refusing to finalize {directory}: {why}.",
        directory=str(directory),
        state=journal.state.value if journal is not None else None,
        command=None,
    )


def stopped(
    directory: Path, doing: str, cause: BaseException, resumption: Resumption
) -> FinalizationError:
    """The error for a finalization of ``directory`` that failed while ``doing``: what stands
    on disk, where the rows are, and the command that finishes the run."""
    reason = str(cause) if isinstance(cause, OSError) else f"{type(cause).__name__}: {cause}"
    errno = cause.errno if isinstance(cause, OSError) else None
    if not directory.is_dir():
        return FinalizationError(
            f"finalizing {directory} stopped while {doing}: {reason}. The run directory is "
            "gone: nothing is left to finalize.",
            directory=str(directory),
            state=None,
            command=None,
            cause_errno=errno,
        )
    journal, readable = _journal_or_none(directory)
    if isinstance(cause, DamagedFileError):
        return _damaged(directory, doing, cause, resumption, journal if readable else None)
    if journal is None:
        finished = not any((directory / name).exists() for name in (HISTORY_PARTS, JOURNAL_FILE))
        if readable and finished and (directory / HISTORY_FILE).is_file():
            safe = "the final files are complete"
        else:
            safe = (
                f"every published part is still in {HISTORY_PARTS}/ and {HISTOGRAM_PARTS}/; "
                "nothing was finalized yet"
            )
    elif journal.state is FinalizationState.WRITING:
        safe = (
            f"the parts in {HISTORY_PARTS}/ and {HISTOGRAM_PARTS}/ are still the source of "
            "truth; the final files are rewritten from them"
        )
    else:
        safe = (
            f"{HISTORY_FILE} ({journal.history_rows} rows) and {HISTOGRAMS_FILE} "
            f"({journal.histogram_rows} rows) are complete; only retiring the parts is left"
        )
    command = resumption.command(directory, journal if readable else None)
    return FinalizationError(
        f"finalizing {directory} stopped while {doing}: {reason}. Nothing is lost: {safe}. "
        f"Fix the cause, then run `{command}` to finish.",
        directory=str(directory),
        state=journal.state.value if journal is not None else None,
        command=command,
        cause_errno=errno,
    )


def _damaged(
    directory: Path,
    doing: str,
    cause: DamagedFileError,
    resumption: Resumption,
    journal: Journal | None,
) -> FinalizationError:
    """The error for a finalization that met a damaged file: what is damaged, that nothing
    was changed, and (for a part) the option that finishes around it."""
    state = journal.state.value if journal is not None else None
    if Path(cause.path).parent.name.endswith(".parts"):
        skip = Resumption(resumption.force, resumption.window, skip_damaged=True)
        command = skip.command(directory, journal)
        return DamagedPartsError(
            f"finalizing {directory} stopped while {doing}: {cause}. Nothing was changed: "
            f"every part is still where it was. To finish without the damaged parts, run "
            f"`{command}` (Python: consolidate(..., skip_damaged=True)): it moves each damaged "
            "part into damaged/ (kept, never deleted), consolidates the rest and records the "
            "gap in index.md and `ti summary`.",
            directory=str(directory),
            state=state,
            command=command,
        )
    return FinalizationError(
        f"finalizing {directory} stopped while {doing}: {cause}. The parts that remain are "
        "kept; no file was replaced by it.",
        directory=str(directory),
        state=state,
        command=None,
    )
