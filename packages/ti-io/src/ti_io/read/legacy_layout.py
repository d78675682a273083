"""What a run directory written by torchinstruments 0.8.0 looks like, and recognizing one.

0.8.0 wrote ``history.parquet`` (or, interrupted, ``history.parts/NNNNNNNN.parquet``) with the
twelve columns of :data:`LEGACY_COLUMNS` and no ``ti`` footer; a directory of its ``rank-NNN``
runs counts as one too. Every ``ti`` command and :func:`ti_io.finish.consolidate` ask
:func:`check_not_legacy` first, and say so in one line instead of failing on missing columns;
converting such a run is :func:`ti_io.upgrade` (:mod:`ti_io.finish.upgrade`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

import pyarrow.parquet as pq

from ti_schema import METADATA_KEY
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, list_rank_dirs

LEGACY_COLUMNS: Final[tuple[str, ...]] = (
    "layer",
    "call_index",
    "signal",
    "tensor_path",
    "sample_id",
    "forward_index",
    "timestamp",
    "shape",
    "dtype",
    "metric",
    "value",
    "unavailable_reason",
)
"""The history columns of torchinstruments 0.8.0, which wrote no ``ti`` footer."""
LEGACY_PART: Final[re.Pattern[str]] = re.compile(r"\d{8}\.parquet")
"""A part file name of 0.8.0's ``history.parts/`` (ordered by name: fixed width)."""


class LegacyRunError(ValueError):
    """A directory written by torchinstruments 0.8.0 was given where a current run is needed."""


def history_files(directory: Path) -> tuple[list[Path], bool]:
    """0.8.0 history files of ``directory`` and whether they are live parts (interrupted)."""
    final = directory / HISTORY_FILE
    if final.is_file():
        return [final], False
    parts = directory / HISTORY_PARTS
    if parts.is_dir():
        found = sorted(p for p in parts.iterdir() if LEGACY_PART.fullmatch(p.name))
        return [p for p in found if p.is_file()], True
    return [], False


def _is_legacy_file(path: Path) -> bool:
    try:
        footer = pq.read_metadata(path)
    except Exception:  # unreadable: not recognizably 0.8.0's
        return False
    if METADATA_KEY in (footer.metadata or {}):
        return False
    return sorted(footer.schema.to_arrow_schema().names) == sorted(LEGACY_COLUMNS)


def legacy_run_reason(directory: Path) -> str | None:
    """Why ``directory`` itself (not its rank directories) holds a 0.8.0 run, or None."""
    files, interrupted = history_files(directory)
    if not files or not _is_legacy_file(files[0]):
        return None
    where = f"{HISTORY_PARTS}/ (interrupted)" if interrupted else HISTORY_FILE
    return f"{where} has torchinstruments 0.8.0's columns and no 'ti' footer"


def rank_dirs(directory: Path) -> list[Path]:
    """The ``rank-NNN`` directories under ``directory``, by rank."""
    return [path for _, path in list_rank_dirs(directory)]


def legacy_reason(directory: str | os.PathLike[str]) -> str | None:
    """Why ``directory`` is a run written by torchinstruments 0.8.0 (one line), or None.

    A directory of 0.8.0 ``rank-NNN`` runs counts too.
    """
    path = Path(directory)
    if not path.is_dir():
        return None
    own = legacy_run_reason(path)
    if own is not None:
        return own
    ranks = [r for r in rank_dirs(path) if legacy_run_reason(r) is not None]
    if ranks:
        names = ", ".join(r.name for r in ranks[:4]) + (", ..." if len(ranks) > 4 else "")
        return f"its rank directories ({names}) hold torchinstruments 0.8.0 runs"
    return None


def check_not_legacy(directory: str | os.PathLike[str], action: str) -> None:
    """Raise :class:`LegacyRunError` (one line, saying what to do) for a 0.8.0 directory."""
    reason = legacy_reason(directory)
    if reason is not None:
        raise LegacyRunError(
            f"{directory} was written by torchinstruments 0.8.0 ({reason}), so it cannot be "
            f"{action}; convert it with `ti upgrade {directory} NEW_DIR` "
            "(ti_io.upgrade) and use NEW_DIR"
        )
