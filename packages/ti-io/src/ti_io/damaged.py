"""Damaged parts: found, moved into ``damaged/`` (never deleted) and recorded as a gap.

``consolidate(..., skip_damaged=True)`` (``ti consolidate --skip-damaged``) verifies every part
(:mod:`ti_io.integrity`); each damaged one is first recorded in ``damaged/skipped.json``
(published atomically: its file, size, what is wrong, and the rows its footer records when the
footer can be read), then moved to ``damaged/<parts directory>/<name>``. The record comes
before the move, so a kill at any point leaves every moved part recorded, and the next run
finds the parts not yet moved damaged again. The consolidation then proceeds from the intact
parts; the record stays in the run and is shown in the run's facts, index.md and ``ti
summary``'s header, so a history with a hole in it is never read unknowingly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ti_io.integrity import DamagedFileError, parquet_rows, verify_parquet
from ti_io.publishing import fsync_dir, publish_text, remove_stale_temporaries
from ti_schema.layout import RUN_DIRS, list_parts

DAMAGED_DIR: Final[str] = "damaged"
"""Where ``--skip-damaged`` keeps the damaged parts of a run, and its record of them."""
SKIPPED_FILE: Final[str] = "skipped.json"
"""The record of the parts skipped, inside :data:`DAMAGED_DIR`."""
_FORMAT: Final[str] = "ti.damaged"
_VERSION: Final[int] = 1


@dataclass(frozen=True)
class SkippedPart:
    """A damaged part that a consolidation left out of the final files."""

    file: str
    """Its path relative to the run (``history.parts/part-000003.parquet``)."""
    bytes: int
    rows: int | None
    """The rows its footer records; None when the footer cannot be read (unknown)."""
    problem: str

    def describe(self) -> str:
        rows = f"{self.rows} rows" if self.rows is not None else "rows unknown"
        return f"{self.file} ({self.bytes} bytes, {rows}): {self.problem}"


def parts_dirs(directory: Path) -> list[Path]:
    """The run's parts directories that exist (history, histograms, events)."""
    return [directory / name for name in RUN_DIRS if name.endswith(".parts")]


def find_damaged_parts(directory: Path) -> list[SkippedPart]:
    """Every part of the run in ``directory`` that fails verification (every page read)."""
    found = []
    for parts in parts_dirs(directory):
        for part in list_parts(parts):
            try:
                verify_parquet(part)
            except DamagedFileError as exc:
                try:
                    rows: int | None = parquet_rows(part)
                except DamagedFileError:
                    rows = None
                found.append(
                    SkippedPart(f"{parts.name}/{part.name}", part.stat().st_size, rows, exc.problem)
                )
    return found


def read_skipped(directory: Path) -> tuple[SkippedPart, ...]:
    """The parts a consolidation of ``directory`` skipped as damaged (empty: none). A record
    that cannot be parsed is reported as one entry saying so, never as no gap."""
    if not (directory / DAMAGED_DIR).is_dir():
        return ()
    try:
        data = (directory / DAMAGED_DIR / SKIPPED_FILE).read_bytes()
    except FileNotFoundError:
        return ()
    return parse_skipped(data)


def parse_skipped(data: bytes) -> tuple[SkippedPart, ...]:
    """The parts the record ``damaged/skipped.json`` (its bytes, wherever it is stored)
    names; a record that cannot be parsed is one entry saying so, never no gap."""
    try:
        doc: Any = json.loads(data.decode("utf-8"))
        entries = doc["skipped"] if doc.get("format") == _FORMAT else None
        if not isinstance(entries, list):
            raise ValueError("no list of skipped parts")
        return tuple(
            SkippedPart(
                str(entry["file"]),
                int(entry["bytes"]),
                None if entry.get("rows") is None else int(entry["rows"]),
                str(entry["problem"]),
            )
            for entry in entries
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return (
            SkippedPart(
                f"{DAMAGED_DIR}/{SKIPPED_FILE}", 0, None, f"the record cannot be read ({exc})"
            ),
        )


def _record(directory: Path, skipped: list[SkippedPart]) -> None:
    doc = {
        "format": _FORMAT,
        "version": _VERSION,
        "skipped": [
            {"file": s.file, "bytes": s.bytes, "rows": s.rows, "problem": s.problem}
            for s in skipped
        ],
    }
    publish_text(directory / DAMAGED_DIR / SKIPPED_FILE, json.dumps(doc, indent=2) + "\n")


def set_aside(directory: Path, damaged: list[SkippedPart]) -> tuple[SkippedPart, ...]:
    """Record ``damaged`` (with what was recorded before), then move each part into
    ``damaged/``; returns every part recorded as skipped."""
    remove_stale_temporaries(directory)  # also a record's, from a publication killed midway
    known = {s.file: s for s in read_skipped(directory)}
    for part in damaged:
        known[part.file] = part
    if not damaged:
        return tuple(known.values())
    (directory / DAMAGED_DIR).mkdir(exist_ok=True)
    _record(directory, list(known.values()))
    moved_into = set()
    for part in damaged:
        target = directory / DAMAGED_DIR / part.file
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(directory / part.file, target)
        moved_into.update({target.parent, (directory / part.file).parent})
    for folder in sorted(moved_into):
        fsync_dir(folder)
    fsync_dir(directory)
    return tuple(known.values())


def gap_lines(skipped: tuple[SkippedPart, ...]) -> list[str]:
    """The skipped parts as lines for a reader: one headline, one line per part."""
    if not skipped:
        return []
    known = [s.rows for s in skipped if s.rows is not None]
    rows = f"{sum(known)} rows" + (" or more" if len(known) < len(skipped) else "")
    if not known:
        rows = "an unknown number of rows"
    return [
        f"{len(skipped)} damaged part(s) were skipped by `ti consolidate --skip-damaged` "
        f"({rows} missing from the final files); they are kept in {DAMAGED_DIR}/",
        *(f"skipped {s.describe()}" for s in skipped),
    ]


__all__ = [
    "DAMAGED_DIR",
    "SKIPPED_FILE",
    "SkippedPart",
    "find_damaged_parts",
    "gap_lines",
    "parse_skipped",
    "parts_dirs",
    "read_skipped",
    "set_aside",
]
