"""Finalizing a run on an object store: the journal's state machine over objects.

The same states and transitions as on disk (:mod:`ti_io.finish.journal`), with objects in
place of files and no rename::

    live or interrupted  --(1) start-->  WRITING  --(2) files written-->  WRITTEN
        --(3) parts deleted, journal deleted-->  finalized

- The journal ``finalization.json`` is one object, replaced whole (a PUT) at each transition;
  it says what is authoritative: no journal or ``writing``: the parts; ``written``: the final
  files.
- ``writing``: the parts are copied into a local temporary directory (``TMPDIR``), the final
  files are written there by the same code as on disk (:func:`ti_io.finish.consolidate.
  _write_final_files`), then each is published as one object (events.parquet,
  history.parquet, histograms.parquet, then result.json and index.md). A resumed ``writing``
  does it all again from the same parts; no final file may shrink.
- ``written``: the final objects must hold the rows recorded; then the parts are deleted
  (publish-then-delete: they go only after the final files are published and recorded), and
  the journal last. A reader that finds the journal ``written`` reads the final files, even
  while the deletion of the parts is half done.

A kill at any point leaves the journal at the last completed step (or none), every object
whole, and ``ti consolidate URI`` finishes the run. There is no lock on an object store: one
finalizer at a time is up to the user (a run is finalized by its writer at removal, or later
by one ``ti consolidate``).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import pyarrow.parquet as pq

from ti_io.damaged import DAMAGED_DIR, SKIPPED_FILE, find_damaged_parts, read_skipped, set_aside
from ti_io.errors import (
    DamagedPartsError,
    FinalizationError,
    NothingToConsolidateError,
    ShrinkRefusedError,
)
from ti_io.facts import RunFacts, read_run_facts
from ti_io.finish.journal import FinalizationState, Journal, Resumption
from ti_io.integrity import DamagedFileError, parquet_rows
from ti_io.progress import ProgressCallback
from ti_io.remote_run import PARTS_DIRS, part_paths, relative, retire_parts, stage
from ti_io.storage import (
    RunLocation,
    exists,
    publish_text,
    read_text,
    upload_file,
)
from ti_schema.layout import (
    EVENT_PARTS,
    EVENTS_FILE,
    HISTOGRAMS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    INDEX_FILE,
    JOURNAL_FILE,
    RESULT_FILE,
    RUN_FILE,
)

_FINAL_ORDER = (EVENTS_FILE, HISTORY_FILE, HISTOGRAMS_FILE, RESULT_FILE, INDEX_FILE)
"""The order the final files are published in: the Parquet files before result.json and
index.md (which list their events and aggregates), as on disk."""
_PAIRS = (
    (HISTORY_FILE, HISTORY_PARTS),
    (HISTOGRAMS_FILE, PARTS_DIRS[1]),
    (EVENTS_FILE, EVENT_PARTS),
)


def read_object_journal(location: RunLocation) -> Journal | None:
    """The journal of the run at ``location``, or None (ValueError when it is not one)."""
    text = read_text(location / JOURNAL_FILE)
    return None if text is None else Journal.from_json(text, location / JOURNAL_FILE)


def _publish(
    location: RunLocation, state: FinalizationState, rows: tuple[int, int] | None = None
) -> Journal:
    journal = Journal(
        state,
        os.getpid(),
        socket.gethostname(),
        rows[0] if rows else None,
        rows[1] if rows else None,
    )
    publish_text(location / JOURNAL_FILE, journal.to_json())
    return journal


def _object_rows(location: RunLocation) -> int | None:
    """Rows the footer of the object at ``location`` records; None when there is none."""
    try:
        with location.filesystem.open_input_file(location.path) as source:
            return int(pq.read_metadata(source).num_rows)
    except FileNotFoundError:
        return None


WriteFinalFiles = Callable[[Path, RunFacts, ProgressCallback | None, str], tuple[int, int]]
"""Writes the final files of the run copied into a local directory (the disk's code,
:func:`ti_io.finish.consolidate._write_final_files`, given the run's URI for index.md);
returns the rows of history and histograms."""


def finalize_object_run(
    location: RunLocation,
    write_final_files: WriteFinalFiles,
    facts: RunFacts | None = None,
    *,
    window: int | None = None,
    resumption: Resumption | None = None,
    progress: ProgressCallback | None = None,
    skip_damaged: bool = False,
) -> tuple[int, int, int, FinalizationState | None, tuple[object, ...]]:
    """Finalize the run at ``location`` from whatever state its journal records (module
    docstring); returns (history rows, histogram rows, parts written, state resumed from,
    skipped parts). Errors as :func:`ti_io.finish.journal.finalize_run`'s."""
    resumption = resumption or Resumption(window=window, skip_damaged=skip_damaged)
    doing = f"reading the finalization journal ({JOURNAL_FILE})"
    try:
        journal = read_object_journal(location)
        resumed_from = journal.state if journal is not None else None
        parts = 0
        skipped: tuple[object, ...] = ()
        if journal is None or journal.state is FinalizationState.WRITING:
            with tempfile.TemporaryDirectory(prefix=".ti-finalize-") as tmp:
                staged = Path(tmp)
                doing = "copying the parts into a local temporary directory"
                names = [
                    f"{HISTORY_PARTS}/{RUN_FILE}",
                    RESULT_FILE,
                    f"{DAMAGED_DIR}/{SKIPPED_FILE}",
                ]
                for parts_dir in PARTS_DIRS:
                    names += [relative(location, p) for p in part_paths(location, parts_dir)]
                stage(location, staged, names)
                if skip_damaged:
                    doing = "verifying the parts and setting the damaged ones aside (damaged/)"
                    _set_damaged_aside(location, staged)
                doing = "checking that no finished file would shrink"
                parts = _refuse_to_shrink(location, staged)
                if journal is None:
                    doing = f"starting the finalization ({JOURNAL_FILE})"
                    journal = _publish(location, FinalizationState.WRITING)
                doing = f"writing {HISTORY_FILE}, {HISTOGRAMS_FILE}, {RESULT_FILE} and {INDEX_FILE}"
                try:
                    run = facts if facts is not None else read_run_facts(staged, window=window)
                    rows = write_final_files(staged, run, progress, location.uri)
                    for name in _FINAL_ORDER:
                        upload_file(location / name, staged / name)
                except DamagedFileError as exc:
                    if resumed_from is None:  # this finalization started it: leave the run as found
                        location.filesystem.delete_file((location / JOURNAL_FILE).path)
                    raise _damaged(location, staged, doing, exc, resumption) from None
                doing = f"recording that the final files are written ({JOURNAL_FILE})"
                journal = _publish(location, FinalizationState.WRITTEN, rows)
                skipped = read_skipped(staged)
        doing = "checking the final files before deleting the parts"
        history_rows, histogram_rows = _check_written(location, journal)
        doing = f"deleting the parts ({', '.join(d + '/' for d in PARTS_DIRS)})"
        retire_parts(location)
        doing = f"deleting {JOURNAL_FILE}"
        location.filesystem.delete_file((location / JOURNAL_FILE).path)
        return history_rows, histogram_rows, parts, resumed_from, skipped
    except (FinalizationError, NothingToConsolidateError):
        raise
    except Exception as exc:
        raise stopped_on_store(location, doing, exc, resumption) from exc


def _set_damaged_aside(location: RunLocation, staged: Path) -> None:
    """``--skip-damaged`` on an object store: the damaged parts (found in the local copy) are
    recorded in ``damaged/skipped.json`` first, then copied to ``damaged/<parts dir>/`` and
    deleted from their parts prefix, as on disk (record, then move)."""
    damaged = find_damaged_parts(staged)
    if not damaged:
        return
    set_aside(staged, damaged)  # the local copy: the record, and the parts moved
    upload_file(location / DAMAGED_DIR / SKIPPED_FILE, staged / DAMAGED_DIR / SKIPPED_FILE)
    for part in damaged:
        upload_file(location / DAMAGED_DIR / part.file, staged / DAMAGED_DIR / part.file)
        location.filesystem.delete_file((location / part.file).path)


def _refuse_to_shrink(location: RunLocation, staged: Path) -> int:
    """ShrinkRefusedError when a final object already holds more rows than the parts it would
    be rewritten from; returns the number of parts."""
    from ti_schema.layout import list_parts

    parts = 0
    for final_name, parts_name in _PAIRS:
        found = list_parts(staged / parts_name)
        parts += len(found)
        try:
            kept = _object_rows(location / final_name)
        except (OSError, ValueError):
            continue  # not a whole Parquet file: nothing finished to keep
        if kept is None:
            continue
        available = sum(parquet_rows(p) for p in found)
        if available < kept:
            raise _refusal(
                location,
                f"{final_name} holds {kept} rows and {parts_name}/ only {available}: a finished "
                f"file is never replaced by a smaller one. If {final_name} is the run's, "
                f"{parts_name}/ lost parts after it was written; to rebuild from the parts "
                f"anyway, move {final_name} aside first",
            )
    return parts


def _check_written(location: RunLocation, journal: Journal) -> tuple[int, int]:
    held_rows = []
    for name, rows in (
        (HISTORY_FILE, journal.history_rows),
        (HISTOGRAMS_FILE, journal.histogram_rows),
    ):
        held = _object_rows(location / name)
        if held is None or held != rows:
            raise _refusal(
                location,
                f"the finalization wrote {rows} rows to {name}, which now "
                f"{'holds ' + str(held) + ' rows' if held is not None else 'is missing'}; "
                f"the parts that remain are kept ({JOURNAL_FILE} records the step)",
            )
        held_rows.append(held)
    event_parts = part_paths(location, EVENT_PARTS)
    if event_parts:
        fs = location.filesystem
        waiting = 0
        for path in event_parts:
            with fs.open_input_file(path) as source:
                waiting += int(pq.read_metadata(source).num_rows)
        held = _object_rows(location / EVENTS_FILE)
        if held is None or held < waiting:
            raise _refusal(
                location,
                f"{EVENT_PARTS}/ holds {waiting} event rows, which {EVENTS_FILE} "
                f"{'holds only ' + str(held) + ' of' if held is not None else 'is missing for'}; "
                f"the parts that remain are kept ({JOURNAL_FILE} records the step)",
            )
    for name in (RESULT_FILE, INDEX_FILE):
        if not exists(location / name):
            raise _refusal(
                location,
                f"the finalization wrote {name}, which is now missing; the parts that remain "
                "are kept",
            )
    return held_rows[0], held_rows[1]


def _journal_or_none(location: RunLocation) -> tuple[Journal | None, bool]:
    try:
        return read_object_journal(location), True
    except (OSError, ValueError):
        return None, False


def _refusal(location: RunLocation, why: str) -> ShrinkRefusedError:
    journal, _ = _journal_or_none(location)
    return ShrinkRefusedError(
        f"refusing to finalize {location}: {why}.",
        directory=str(location),
        state=journal.state.value if journal is not None else None,
        command=None,
    )


def _damaged(
    location: RunLocation,
    staged: Path,
    doing: str,
    cause: DamagedFileError,
    resumption: Resumption,
) -> FinalizationError:
    try:
        name = str(Path(cause.path).relative_to(staged))
    except ValueError:
        name = str(cause.path)
    where = f"{location}/{PurePosixPath(name).as_posix()}"
    journal, readable = _journal_or_none(location)
    state = journal.state.value if journal is not None else None
    if name.split("/", 1)[0].endswith(".parts"):
        skip = Resumption(resumption.force, resumption.window, skip_damaged=True)
        command = skip.command(location, journal if readable else None)
        return DamagedPartsError(
            f"finalizing {location} stopped while {doing}: {where} is damaged: {cause.problem}. "
            "Nothing was changed: every part is still where it was. To finish without the "
            f"damaged parts, run `{command}` (Python: consolidate(..., skip_damaged=True)): it "
            "moves each damaged part into damaged/ (kept, never deleted), consolidates the "
            "rest and records the gap in index.md and `ti summary`.",
            directory=str(location),
            state=state,
            command=command,
        )
    return FinalizationError(
        f"finalizing {location} stopped while {doing}: {where} is damaged: {cause.problem}. "
        "The parts that remain are kept; no file was replaced by it.",
        directory=str(location),
        state=state,
        command=None,
    )


def stopped_on_store(
    location: RunLocation, doing: str, cause: BaseException, resumption: Resumption
) -> FinalizationError:
    """The error for a finalization of ``location`` that failed while ``doing``: what stands
    in the store, where the rows are, and the command that finishes the run."""
    reason = str(cause) if isinstance(cause, OSError) else f"{type(cause).__name__}: {cause}"
    journal, readable = _journal_or_none(location)
    if journal is None:
        safe = (
            f"every published part is still under {HISTORY_PARTS}/ and {PARTS_DIRS[1]}/; "
            "nothing was finalized yet"
        )
    elif journal.state is FinalizationState.WRITING:
        safe = (
            f"the parts under {HISTORY_PARTS}/ and {PARTS_DIRS[1]}/ are still the source of "
            "truth; the final files are rewritten from them"
        )
    else:
        safe = (
            f"{HISTORY_FILE} ({journal.history_rows} rows) and {HISTOGRAMS_FILE} "
            f"({journal.histogram_rows} rows) are complete; only deleting the parts is left"
        )
    command = resumption.command(location, journal if readable else None)
    return FinalizationError(
        f"finalizing {location} stopped while {doing}: {reason}. Nothing is lost: {safe}. "
        f"Fix the cause, then run `{command}` to finish.",
        directory=str(location),
        state=journal.state.value if journal is not None else None,
        command=command,
        cause_errno=cause.errno if isinstance(cause, OSError) else None,
    )
