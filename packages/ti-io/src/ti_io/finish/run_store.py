"""What finalizing a run needs of the place the run lives, declared once.

Finalization is one state machine (:mod:`ti_io.finish.finalization`) and one ``consolidate``
(:mod:`ti_io.finish.consolidate`); both run over a :class:`RunStore`. Each backend is one small
module that says how its storage does each step:

- :mod:`ti_io.finish.disk_store`: a local directory: a file is published by temporary file,
  fsync and rename; parts are retired by renaming their directory away; one finalizer at a
  time by an exclusive ``flock``; parts are read in place.
- :mod:`ti_io.finish.object_store`: a prefix on an object store (any pyarrow filesystem): no
  rename, no append, no lock; each file is one whole-object PUT; parts are listed by name and
  deleted in batches; they are read from a local copy (the workspace).

What differs is declared (:attr:`RunStore.copies_parts`, :attr:`RunStore.words`), never
probed from the type of a path.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ti_io.errors import FinalizationError

if TYPE_CHECKING:
    from ti_io.damaged import SkippedPart
    from ti_io.finish.journal import Journal
    from ti_io.integrity import DamagedFileError
    from ti_io.storage import RunLocation


@dataclass(frozen=True)
class StoreWords:
    """How messages name a backend's things (``ti consolidate`` prints them)."""

    unit: str
    """What holds a run: ``"directory"`` or ``"prefix"``."""
    parts_in: str
    """How rows sit in parts: ``"in"`` (a directory) or ``"under"`` (a prefix)."""
    retiring: str
    """What retiring the parts is: ``"retiring"`` (renamed away, then removed) or
    ``"deleting"``."""


@dataclass(frozen=True)
class FinishedRun:
    """A run already finalized: its final files' rows and the damaged parts it skipped."""

    history_rows: int
    histogram_rows: int
    skipped: tuple[SkippedPart, ...]


class RunStore(Protocol):
    """The operations finalization makes on a run's storage, each durable when it returns."""

    @property
    def where(self) -> Path | RunLocation:
        """The run, as messages and commands name it."""
        ...

    @property
    def words(self) -> StoreWords: ...

    @property
    def copies_parts(self) -> bool:
        """Whether the parts are copied into a local workspace before they are read (an
        object store) or read where they are (a directory)."""
        ...

    @property
    def shown(self) -> str | None:
        """The run's URI for index.md when the final files are written in a local copy."""
        ...

    def still_there(self) -> bool:
        """Whether the run's directory still exists (a prefix always does)."""
        ...

    def refuse_legacy(self) -> None:
        """``LegacyRunError`` for a run written by torchinstruments 0.8.0."""
        ...

    def exclusive(self) -> AbstractContextManager[None]:
        """Hold the run for one finalizer (FinalizationBusyError when another holds it)."""
        ...

    def read_journal(self) -> Journal | None:
        """The journal, or None (ValueError when it is not one, OSError when unreadable)."""
        ...

    def publish_journal(self, journal: Journal) -> None: ...

    def remove_journal(self) -> None: ...

    def workspace(self) -> AbstractContextManager[Path]:
        """A local directory holding the run's parts, run.json, result.json and
        ``damaged/skipped.json``, in which the final files are written."""
        ...

    def set_damaged_aside(self, work: Path) -> None:
        """Record the damaged parts (found in ``work``), then move them into ``damaged/``."""
        ...

    def finished_before_journals(self) -> Journal | None:
        """The ``written`` journal of a run an earlier ti-io (before journals) left half
        retired; None for any other run (ShrinkRefusedError when retiring would lose rows)."""
        ...

    def remove_stale_temporaries(self) -> None:
        """Remove what interrupted writes left behind (only while holding the run)."""
        ...

    def publish_final_files(self, work: Path) -> None:
        """Make the final files written in ``work`` the run's, in the order readers need."""
        ...

    def final_rows(self, name: str) -> int | None:
        """Rows the footer of the final file ``name`` records; None when it is missing,
        DamagedFileError when its footer cannot be read."""
        ...

    def waiting_rows(self, parts_dir: str) -> int:
        """Rows of the parts left in ``parts_dir``."""
        ...

    def has_file(self, name: str) -> bool: ...

    def has_parts(self, *parts_dirs: str) -> bool:
        """Whether any of the parts directories ``parts_dirs`` is still there (a directory;
        on an object store, a part under the prefix)."""
        ...

    def retire_parts(self) -> None:
        """Remove every parts directory (only once the final files are recorded)."""
        ...

    def recorded_skipped(self) -> tuple[SkippedPart, ...]:
        """The damaged parts the run's record (``damaged/skipped.json``) names."""
        ...

    def finished(self) -> FinishedRun | None:
        """The final files of a finalized run (no journal, no parts); None when there are
        none. FinalizationError when a final file is damaged."""
        ...

    def rank_names(self) -> list[str]:
        """The ``rank-NNN`` runs directly below this one."""
        ...

    def run_facts_text(self) -> str | None:
        """``history.parts/run.json``, the writer's facts, or None."""
        ...

    def damaged_name(self, path: Path | str) -> tuple[str, bool]:
        """A damaged file (a path in the workspace, or already the run's name for it) as the
        run names it, and whether it is a part."""
        ...


def damaged_final(where: Path | RunLocation, cause: DamagedFileError) -> FinalizationError:
    """The error for a finalized run whose final file is damaged: nothing can rebuild it."""
    return FinalizationError(
        f"{where} is finalized, but {cause}. Its parts were retired after finalization, so "
        "nothing in the run can rebuild it; nothing was changed. Restore the file from a copy "
        "of the run if one exists.",
        directory=str(where),
        state=None,
        command=None,
    )
