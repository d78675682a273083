"""The on-disk layout of a run: file and directory names, part files, rank directories.

The one definition every writer and reader uses: ti-io writes and reads it, ti-dist reads it
across ranks, ``ti validate`` and the conformance kit check it. How files are written
(temporaries, fsync, atomic renames, removal) belongs to ti-io. A run directory::

    history.parquet        histograms.parquet      events.parquet   result.json      index.md
    tensorboard/           event files
    history.parts/         part-000000.parquet, part-000001.parquet, ..., run.json (live runs)
    histograms.parts/      part-000000.parquet, ...                              (live runs)
    events.parts/          part-000000.parquet, ... one per event                (live runs)
    finalization.json      the finalization journal (only while a finalization is unfinished)

When every rank writes, ``output_dir/rank-000/``, ``output_dir/rank-001/``, ... each hold one.
Parts are ordered by their number (not by name: ``part-1000000`` follows ``part-999999``);
anything else in a parts directory (temporaries, strangers) is not a part.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

HISTORY_FILE: Final[str] = "history.parquet"
HISTOGRAMS_FILE: Final[str] = "histograms.parquet"
EVENTS_FILE: Final[str] = "events.parquet"
RESULT_FILE: Final[str] = "result.json"
INDEX_FILE: Final[str] = "index.md"
HISTORY_PARTS: Final[str] = "history.parts"
HISTOGRAM_PARTS: Final[str] = "histograms.parts"
EVENT_PARTS: Final[str] = "events.parts"
"""Live ``ti.events`` parts: one part per event, published at once (an event is urgent)."""
TENSORBOARD_DIR: Final[str] = "tensorboard"
RUN_FILE: Final[str] = "run.json"
"""Run facts kept inside ``history.parts/`` while the run is unconsolidated."""
JOURNAL_FILE: Final[str] = "finalization.json"
"""The finalization journal: present from the start of a finalization until it has finished,
it records the last step completed so an interrupted finalization resumes instead of starting
over. Its format (``ti_io.finish.journal``) and states (``ti_io.finish.finalization``) are
ti-io's (docs/artifacts.md)."""

RUN_FILES: Final[tuple[str, ...]] = (
    HISTORY_FILE,
    HISTOGRAMS_FILE,
    EVENTS_FILE,
    RESULT_FILE,
    INDEX_FILE,
    JOURNAL_FILE,
)
RUN_DIRS: Final[tuple[str, ...]] = (HISTORY_PARTS, HISTOGRAM_PARTS, EVENT_PARTS, TENSORBOARD_DIR)
RUN_ENTRIES: Final[tuple[str, ...]] = RUN_FILES + RUN_DIRS
"""Every top-level entry a run owns; their presence marks a directory as holding a run."""

PART_PATTERN: Final[re.Pattern[str]] = re.compile(r"part-(\d{6,})\.parquet")
"""A published part's file name; the group is its number."""
RANK_DIR_PATTERN: Final[re.Pattern[str]] = re.compile(r"rank-(\d{3,})")
"""A rank-private run directory's name; the group is the global rank."""


def _index(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


def part_name(index: int) -> str:
    """File name of part ``index``: ``part-000042.parquet``."""
    return f"part-{_index(index, 'part index'):06d}.parquet"


def part_index(name: str) -> int | None:
    """The number of the part called ``name``, or None when ``name`` is not a part."""
    match = PART_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def list_parts(directory: str | os.PathLike[str]) -> list[Path]:
    """The published parts in ``directory`` in part order (empty when it does not exist)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        index = part_index(child.name)
        if index is not None and child.is_file():
            found.append((index, child))
    return [path for _, path in sorted(found)]


def rank_dir_name(rank: int) -> str:
    """The rank-private directory of global rank ``rank``: ``rank-000``, ``rank-1234``."""
    return f"rank-{_index(rank, 'rank'):03d}"


def rank_of_dir(name: str) -> int | None:
    """The global rank a directory called ``name`` belongs to, or None when it is no rank's."""
    match = RANK_DIR_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def list_rank_dirs(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(rank, directory)`` of every rank-private run under ``output_dir``, by rank."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        rank = rank_of_dir(child.name)
        if rank is not None and child.is_dir():
            found.append((rank, child))
    return sorted(found)
