"""Finalizing a run on an object store: the store's side of :class:`~ti_io.finish.run_store.
RunStore`.

There is no rename and no append: the journal and each final file are one object, replaced
whole by a PUT (:func:`ti_io.storage.publish_bytes`), so a kill leaves every object whole or
absent. The parts are copied into a local temporary directory (``TMPDIR``, the workspace) and
the final files written there by the disk's code, then each is published as one object
(events.parquet, history.parquet, histograms.parquet, then result.json and index.md, which list
the events and aggregates). Parts are found by name (pyarrow may leave a directory-marker object
behind a delete) and deleted only once the final files are recorded (publish-then-delete).
There is no lock: one finalizer at a time is up to the user (a run is finalized by its writer
at removal, or later by one ``ti consolidate``).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ti_io.damaged import DAMAGED_DIR, SKIPPED_FILE, SkippedPart, find_damaged_parts, parse_skipped
from ti_io.damaged import set_aside as set_aside_locally
from ti_io.finish.journal import Journal
from ti_io.finish.run_store import FinishedRun, StoreWords, damaged_final
from ti_io.integrity import DamagedFileError, object_footer, verify_object
from ti_io.remote_run import PARTS_DIRS, part_paths, relative, retire_parts, stage
from ti_io.storage import (
    RunLocation,
    exists,
    list_names,
    publish_text,
    read_bytes,
    read_text,
    upload_file,
)
from ti_schema.layout import (
    EVENTS_FILE,
    HISTOGRAMS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    INDEX_FILE,
    JOURNAL_FILE,
    RANK_DIR_PATTERN,
    RESULT_FILE,
    RUN_FILE,
)

_FINAL_ORDER = (EVENTS_FILE, HISTORY_FILE, HISTOGRAMS_FILE, RESULT_FILE, INDEX_FILE)
"""The order the final files are published in: the Parquet files before result.json and
index.md (which list their events and aggregates), as on disk."""
_PARTS_PREFIXES = tuple(f"{name}/" for name in PARTS_DIRS)
_WORDS = StoreWords(unit="prefix", parts_in="under", retiring="deleting")


class ObjectStore:
    """The run under the object-store prefix ``location``."""

    copies_parts = True
    words = _WORDS

    def __init__(self, location: RunLocation) -> None:
        self.location = location
        self._work: Path | None = None

    @property
    def where(self) -> RunLocation:
        return self.location

    @property
    def shown(self) -> str:
        return self.location.uri

    def still_there(self) -> bool:
        return True  # a prefix exists while anything is under it; nothing to tell apart

    def refuse_legacy(self) -> None:
        pass  # torchinstruments 0.8.0 wrote only local directories

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield  # no lock on an object store (module docstring)

    def read_journal(self) -> Journal | None:
        text = read_text(self.location / JOURNAL_FILE)
        return None if text is None else Journal.from_json(text, self.location / JOURNAL_FILE)

    def publish_journal(self, journal: Journal) -> None:
        publish_text(self.location / JOURNAL_FILE, journal.to_json())

    def remove_journal(self) -> None:
        self.location.filesystem.delete_file((self.location / JOURNAL_FILE).path)

    @contextlib.contextmanager
    def workspace(self) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix=".ti-finalize-") as tmp:
            work = Path(tmp)
            names = [f"{HISTORY_PARTS}/{RUN_FILE}", RESULT_FILE, f"{DAMAGED_DIR}/{SKIPPED_FILE}"]
            for parts_dir in PARTS_DIRS:
                names += [relative(self.location, p) for p in part_paths(self.location, parts_dir)]
            stage(self.location, work, names)
            self._work = work
            yield work

    def set_damaged_aside(self, work: Path) -> None:
        """The damaged parts (found in the local copy) are recorded in
        ``damaged/skipped.json`` first, then copied to ``damaged/<parts dir>/`` and deleted
        from their parts prefix, as on disk (record, then move)."""
        damaged = find_damaged_parts(work)
        if not damaged:
            return
        set_aside_locally(work, damaged)  # the local copy: the record, and the parts moved
        location = self.location
        upload_file(location / DAMAGED_DIR / SKIPPED_FILE, work / DAMAGED_DIR / SKIPPED_FILE)
        for part in damaged:
            upload_file(location / DAMAGED_DIR / part.file, work / DAMAGED_DIR / part.file)
            location.filesystem.delete_file((location / part.file).path)

    def finished_before_journals(self) -> Journal | None:
        return None  # every ti-io that wrote to object stores had journals

    def remove_stale_temporaries(self) -> None:
        pass  # an interrupted upload is never visible (docs/reliability.md)

    def publish_final_files(self, work: Path) -> None:
        for name in _FINAL_ORDER:
            upload_file(self.location / name, work / name)

    def final_rows(self, name: str) -> int | None:
        target = self.location / name
        try:
            return int(object_footer(target.filesystem, target.path, target.uri).num_rows)
        except FileNotFoundError:
            return None

    def waiting_rows(self, parts_dir: str) -> int:
        location = self.location
        return sum(
            int(object_footer(location.filesystem, path, self._uri(path)).num_rows)
            for path in part_paths(location, parts_dir)
        )

    def _uri(self, path: str) -> str:
        """The URI of the object ``path`` below the run."""
        return f"{self.location.uri.rstrip('/')}/{relative(self.location, path)}"

    def has_file(self, name: str) -> bool:
        return exists(self.location / name)

    def has_parts(self, *parts_dirs: str) -> bool:
        return any(part_paths(self.location, name) for name in parts_dirs)

    def retire_parts(self) -> None:
        retire_parts(self.location)

    def recorded_skipped(self) -> tuple[SkippedPart, ...]:
        data = read_bytes(self.location / DAMAGED_DIR / SKIPPED_FILE)
        return () if data is None else parse_skipped(data)

    def finished(self) -> FinishedRun | None:
        """Its final objects verified (every page, :func:`ti_io.integrity.verify_object`),
        their rows."""
        fs = self.location.filesystem
        rows: list[int | None] = []
        for name in (HISTORY_FILE, HISTOGRAMS_FILE):
            target = self.location / name
            try:
                rows.append(verify_object(fs, target.path, target.uri).rows)
            except FileNotFoundError:
                rows.append(None)
            except DamagedFileError as exc:
                raise damaged_final(self.location, exc) from None
        if rows[0] is None:
            return None
        return FinishedRun(rows[0], rows[1] or 0, self.recorded_skipped())

    def rank_names(self) -> list[str]:
        return [n for n in list_names(self.location) if RANK_DIR_PATTERN.fullmatch(n)]

    def run_facts_text(self) -> str | None:
        data = read_bytes(self.location / HISTORY_PARTS / RUN_FILE)
        return None if data is None else data.decode("utf-8", errors="replace")

    def damaged_name(self, path: Path | str) -> tuple[str, bool]:
        # ``_work`` is the last workspace's path, kept after it is removed: only its text is
        # used, to name a file found damaged there as the run's object.
        try:
            if self._work is None:
                raise ValueError
            name = Path(path).relative_to(self._work).as_posix()
        except ValueError:  # already the object's URI (a final file read from the store)
            return str(path), False
        return f"{self.location}/{name}", name.startswith(_PARTS_PREFIXES)
