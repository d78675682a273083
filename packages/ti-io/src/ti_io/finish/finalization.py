"""Finalizing a run: a state machine that resumes from any point.

Finalizing (``DirectorySink.close``, ``ti consolidate``) turns a run's parts into its final
files and then retires the parts. The process may be killed at any instruction and any file
operation may fail, so the last step completed is recorded in the journal
(``finalization.json``, ``ti_schema.layout.JOURNAL_FILE``) before the next step starts, and
every step may be run again: the next finalization resumes where the last one stopped. This
module is the one definition of the states and their transitions (the journal file itself is
:mod:`ti_io.finish.journal`)::

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
into ``damaged/``) while the run is held (on disk, under its lock) and the parts are the source
of truth (no journal, or ``writing``), before anything is counted or written.

The states and transitions are the same wherever the run lives; each step is done by the run's
:class:`~ti_io.finish.run_store.RunStore` (:mod:`ti_io.finish.run_store` says what it must do):
a local directory (:mod:`ti_io.finish.disk_store`: temporary file, fsync, rename; parts retired
by renaming their directory away; an exclusive ``flock`` keeps finalizers apart) or a prefix on
an object store (:mod:`ti_io.finish.object_store`: whole-object PUTs, the parts read from a
local copy, deleted in batches; no lock). Every transition is published after the work of its
step is durable. Parts are retired only in ``written``, so a history is never rebuilt from fewer
parts than it was written from, and a final Parquet file is never replaced by one with fewer
rows. A run finalized by an earlier ti-io (no journal) and interrupted between retiring
``history.parts/`` and ``histograms.parts/`` is recognized (history.parquet present,
``history.parts/`` gone: every final file was written before either retirement) and finished by
retiring the rest, never rebuilt. While a finalizer holds the run it removes temporaries that
interrupted writes left behind.
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ti_io.damaged import SkippedPart, read_skipped
from ti_io.errors import (
    DamagedPartsError,
    FinalizationBusyError,
    FinalizationError,
    ShrinkRefusedError,
)
from ti_io.finish.journal import FinalizationState, Journal
from ti_io.integrity import DamagedFileError, parquet_rows
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
)

if TYPE_CHECKING:
    from ti_io.finish.run_store import RunStore
    from ti_io.storage import RunLocation

_PAIRS: Final[tuple[tuple[str, str], ...]] = (
    (HISTORY_FILE, HISTORY_PARTS),
    (HISTOGRAMS_FILE, HISTOGRAM_PARTS),
    (EVENTS_FILE, EVENT_PARTS),
)
"""Each final Parquet file and the parts it is written from."""
_PARTS_DIRS: Final[str] = ", ".join(f"{parts}/" for _, parts in _PAIRS)


@dataclass(frozen=True)
class Finalized:
    """What :func:`finalize_run` did."""

    history_rows: int
    histogram_rows: int
    parts: int
    """Parts written into the final files (0 when it only finished a retirement)."""
    resumed_from: FinalizationState | None
    """The state a journal recorded when this finalization began, or None (a fresh start)."""
    skipped: tuple[SkippedPart, ...] = ()
    """The damaged parts the run's record names (set aside by this finalization or before)."""


WriteFiles = Callable[[Path], tuple[int, int]]
"""Writes history.parquet, histograms.parquet, events.parquet, result.json and index.md from
the parts in the workspace it is given (each published atomically there); returns the rows of
the two Parquet files."""


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
    store: RunStore, write_files: WriteFiles, resumption: Resumption, *, skip_damaged: bool = False
) -> Finalized:
    """Finalize the run in ``store`` from whatever state it is in (module docstring).

    With ``skip_damaged`` the damaged parts are set aside under the finalization
    lock while the parts are still the source of truth (no journal, or ``writing``), before
    they are counted.

    Raises FinalizationBusyError when another process holds the run's finalization lock,
    ShrinkRefusedError when a finished file would shrink or a retirement would lose rows, and
    FinalizationError (saying what is safe and which command finishes the run) for any other
    failure.
    """
    finalization = _Finalization(store)
    try:
        with store.exclusive():
            return finalization.run(write_files, skip_damaged=skip_damaged)
    except (FinalizationError, FinalizationBusyError):
        raise
    except Exception as exc:  # every other failure: say where things stand, how to go on
        raise stopped(store, finalization.doing, exc, resumption) from exc


class _Finalization:
    """One finalization: runs the transitions in order; ``doing`` names the current step."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.doing = "taking the finalization lock"

    def run(self, write_files: WriteFiles, *, skip_damaged: bool) -> Finalized:
        store = self.store
        self.doing = f"reading the finalization journal ({JOURNAL_FILE})"
        journal = store.read_journal()
        resumed_from = journal.state if journal is not None else None
        parts = 0
        skipped: tuple[SkippedPart, ...] | None = None
        if journal is None or journal.state is FinalizationState.WRITING:
            if store.copies_parts:
                self.doing = "copying the parts into a local temporary directory"
            with store.workspace() as work:
                journal, parts, resumed_from = self._write(
                    work, journal, resumed_from, write_files, skip_damaged
                )
                skipped = read_skipped(work)
        else:
            self.doing = "removing temporaries of interrupted writes"
            store.remove_stale_temporaries()
        self.doing = f"checking the final files before {store.words.retiring} the parts"
        history_rows, histogram_rows = _check_written(store, journal)
        if skipped is None:  # read while the journal still says where the run stands
            self.doing = "reading the record of damaged parts"
            skipped = store.recorded_skipped()
        self.doing = f"{store.words.retiring} the parts ({_PARTS_DIRS})"
        store.retire_parts()
        self.doing = f"removing {JOURNAL_FILE}"
        store.remove_journal()
        return Finalized(history_rows, histogram_rows, parts, resumed_from, skipped)

    def _write(
        self,
        work: Path,
        journal: Journal | None,
        resumed_from: FinalizationState | None,
        write_files: WriteFiles,
        skip_damaged: bool,
    ) -> tuple[Journal, int, FinalizationState | None]:
        """The steps while the parts are the source of truth: (1) and (2) of the module
        docstring, in the workspace; returns the journal, the parts written, the state
        resumed from."""
        store = self.store
        parts = 0
        if skip_damaged:
            self.doing = "verifying the parts and setting the damaged ones aside (damaged/)"
            store.set_damaged_aside(work)
        if journal is None:
            self.doing = "checking for a finalization an earlier ti-io left unfinished"
            journal = store.finished_before_journals()
            if journal is not None:
                resumed_from = journal.state
                self.doing = f"recording the finished files ({JOURNAL_FILE})"
                store.publish_journal(_stamped(journal))
        if journal is None or journal.state is FinalizationState.WRITING:
            self.doing = "checking that no finished file would shrink"
            parts = _refuse_to_shrink(store, work)  # before anything is changed
        if journal is None:
            self.doing = f"starting the finalization ({JOURNAL_FILE})"
            journal = _stamped(Journal(FinalizationState.WRITING, 0, ""))
            store.publish_journal(journal)
        self.doing = "removing temporaries of interrupted writes"
        store.remove_stale_temporaries()
        if journal.state is FinalizationState.WRITING:
            self.doing = (
                f"writing {HISTORY_FILE}, {HISTOGRAMS_FILE}, {RESULT_FILE} and {INDEX_FILE}"
            )
            try:
                rows = write_files(work)
                store.publish_final_files(work)
            except DamagedFileError:
                if resumed_from is None:  # this finalization started it: leave the run as found
                    store.remove_journal()
                raise
            self.doing = f"recording that the final files are written ({JOURNAL_FILE})"
            journal = _stamped(Journal(FinalizationState.WRITTEN, 0, "", *rows))
            store.publish_journal(journal)
        return journal, parts, resumed_from


def _stamped(journal: Journal) -> Journal:
    """``journal`` as this process publishes it."""
    return replace(journal, pid=os.getpid(), host=socket.gethostname())


def _refuse_to_shrink(store: RunStore, work: Path) -> int:
    """Raise ShrinkRefusedError when a final Parquet file already holds more rows than the
    parts (in ``work``) it would be rewritten from; returns the number of parts."""
    parts = 0
    for final_name, parts_name in _PAIRS:
        found = list_parts(work / parts_name)
        parts += len(found)
        try:
            kept = store.final_rows(final_name)
        except DamagedFileError:
            continue  # not a whole Parquet file: nothing finished to keep; rewritten from parts
        if kept is None:
            continue
        available = sum(parquet_rows(p) for p in found)
        if available < kept:
            raise _refusal(
                store,
                f"{final_name} holds {kept} rows and {parts_name}/ only {available}: a finished "
                f"file is never replaced by a smaller one. If {final_name} is the run's, "
                f"{parts_name}/ lost parts after it was written; to rebuild from the parts "
                f"anyway, move {final_name} aside first",
            )
    return parts


def _check_written(store: RunStore, journal: Journal) -> tuple[int, int]:
    """Before parts are retired: the final files are there and hold the rows written; returns
    those rows (history, histograms)."""
    held_rows = []
    for name, rows in (
        (HISTORY_FILE, journal.history_rows),
        (HISTOGRAMS_FILE, journal.histogram_rows),
    ):
        held = store.final_rows(name)
        if held is None or held != rows:
            raise _refusal(
                store,
                f"the finalization wrote {rows} rows to {name}, which now "
                f"{'holds ' + str(held) + ' rows' if held is not None else 'is missing'}; "
                f"the parts that remain are kept ({JOURNAL_FILE} records the step)",
            )
        held_rows.append(held)
    events_waiting = store.waiting_rows(EVENT_PARTS)
    if events_waiting:
        # events.parquet is written with the other files (``writing``); the journal of an
        # earlier ti-io has no count for it, so its parts left must all be in it.
        held = store.final_rows(EVENTS_FILE)
        if held is None or held < events_waiting:
            raise _refusal(
                store,
                f"{EVENT_PARTS}/ holds {events_waiting} event rows, which {EVENTS_FILE} "
                f"{'holds only ' + str(held) + ' of' if held is not None else 'is missing for'}; "
                f"the parts that remain are kept ({JOURNAL_FILE} records the step)",
            )
    for name in (RESULT_FILE, INDEX_FILE):
        if not store.has_file(name):
            raise _refusal(
                store,
                f"the finalization wrote {name}, which is now missing; the parts that remain "
                "are kept",
            )
    return held_rows[0], held_rows[1]


def _journal_or_none(store: RunStore) -> tuple[Journal | None, bool]:
    """The journal after a failure, and whether it could be read at all."""
    try:
        return store.read_journal(), True
    except (OSError, ValueError):
        return None, False


def _refusal(store: RunStore, why: str) -> ShrinkRefusedError:
    journal, _ = _journal_or_none(store)
    return ShrinkRefusedError(
        f"refusing to finalize {store.where}: {why}.",
        directory=str(store.where),
        state=journal.state.value if journal is not None else None,
        command=None,
    )


def stopped(
    store: RunStore, doing: str, cause: BaseException, resumption: Resumption
) -> FinalizationError:
    """The error for a finalization of ``store`` that failed while ``doing``: what stands in
    the store, where the rows are, and the command that finishes the run."""
    where = store.where
    reason = str(cause) if isinstance(cause, OSError) else f"{type(cause).__name__}: {cause}"
    errno = cause.errno if isinstance(cause, OSError) else None
    if not store.still_there():
        return FinalizationError(
            f"finalizing {where} stopped while {doing}: {reason}. The run {store.words.unit} "
            "is gone: nothing is left to finalize.",
            directory=str(where),
            state=None,
            command=None,
            cause_errno=errno,
        )
    journal, readable = _journal_or_none(store)
    if isinstance(cause, DamagedFileError):
        return _damaged(store, doing, cause, resumption, journal if readable else None)
    parts_in = f"{store.words.parts_in} {HISTORY_PARTS}/ and {HISTOGRAM_PARTS}/"
    if journal is None:
        if readable and _finished(store):
            safe = "the final files are complete"
        else:
            safe = f"every published part is still {parts_in}; nothing was finalized yet"
    elif journal.state is FinalizationState.WRITING:
        safe = (
            f"the parts {parts_in} are still the source of truth; the final files are "
            "rewritten from them"
        )
    else:
        safe = (
            f"{HISTORY_FILE} ({journal.history_rows} rows) and {HISTOGRAMS_FILE} "
            f"({journal.histogram_rows} rows) are complete; only {store.words.retiring} the "
            "parts is left"
        )
    command = resumption.command(where, journal if readable else None)
    return FinalizationError(
        f"finalizing {where} stopped while {doing}: {reason}. Nothing is lost: {safe}. "
        f"Fix the cause, then run `{command}` to finish.",
        directory=str(where),
        state=journal.state.value if journal is not None else None,
        command=command,
        cause_errno=errno,
    )


def _finished(store: RunStore) -> bool:
    """No journal, history.parquet written and its parts retired: every final file was
    written before either retirement (the run was finalized, or only retiring is left)."""
    try:
        return not store.has_parts(HISTORY_PARTS) and store.has_file(HISTORY_FILE)
    except (OSError, ValueError):
        return False


def _damaged(
    store: RunStore,
    doing: str,
    cause: DamagedFileError,
    resumption: Resumption,
    journal: Journal | None,
) -> FinalizationError:
    """The error for a finalization that met a damaged file: what is damaged, that nothing
    was changed, and (for a part) the option that finishes around it."""
    where = store.where
    name, is_part = store.damaged_name(cause.path)
    state = journal.state.value if journal is not None else None
    if is_part:
        skip = Resumption(resumption.force, resumption.window, skip_damaged=True)
        command = skip.command(where, journal)
        return DamagedPartsError(
            f"finalizing {where} stopped while {doing}: {name} is damaged: {cause.problem}. "
            "Nothing was changed: every part is still where it was. To finish without the "
            f"damaged parts, run `{command}` (Python: consolidate(..., skip_damaged=True)): it "
            "moves each damaged part into damaged/ (kept, never deleted), consolidates the "
            "rest and records the gap in index.md and `ti summary`.",
            directory=str(where),
            state=state,
            command=command,
        )
    return FinalizationError(
        f"finalizing {where} stopped while {doing}: {name} is damaged: {cause.problem}. The "
        "parts that remain are kept; no file was replaced by it.",
        directory=str(where),
        state=state,
        command=None,
    )


__all__ = ["Finalized", "Resumption", "WriteFiles", "finalize_run", "stopped"]
