"""The finalization journal (``finalization.json``, ``ti_schema.layout.JOURNAL_FILE``): the
step a finalization of a run has completed, as the run records it.

Its states, their transitions and how a finalization resumes from each are
:mod:`ti_io.finish.finalization`'s; this module owns the file: its format, reading it, and the
runs whose finalization was interrupted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ti_schema.layout import JOURNAL_FILE, list_rank_dirs

if TYPE_CHECKING:
    from ti_io.storage import RunLocation

JOURNAL_FORMAT: Final[str] = "ti.finalization"
"""The ``format`` key of every journal."""
JOURNAL_VERSION: Final[int] = 1


class FinalizationState(StrEnum):
    """The step a finalization has completed, as its journal records it
    (:mod:`ti_io.finish.finalization` defines the transitions)."""

    WRITING = "writing"
    """Started: the parts are the source of truth; the final files are being written."""
    WRITTEN = "written"
    """The final files are complete; the parts are being retired."""


@dataclass(frozen=True)
class Journal:
    """The content of ``finalization.json``."""

    state: FinalizationState
    pid: int
    """The process finalizing (informational: on disk, the lock says whether one is at work)."""
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


__all__ = [
    "JOURNAL_FORMAT",
    "JOURNAL_VERSION",
    "FinalizationState",
    "Journal",
    "interrupted_finalizations",
    "read_journal",
]
