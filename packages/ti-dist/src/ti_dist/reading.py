"""Read every rank's history of a run as one Polars LazyFrame, ``rank`` column intact.

Layout (:mod:`ti_schema.layout`, docs/distributed.md): with every rank writing,
``output_dir/rank-NNN/`` each hold a full artifact set; with ``Rank0Only`` (or a single process)
the artifacts sit in ``output_dir`` itself. A rank whose run finished has ``history.parquet``; a
rank still running, or one that was killed, has only completed parts in ``history.parts/``. Rows
are returned as written: nothing is averaged.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import polars as pl

from ti_io.integrity import verify_files
from ti_io.read.frames import plain_strings
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, list_parts, list_rank_dirs

if TYPE_CHECKING:
    from ti_io.storage import RunLocation

_ENGINE_ARGUMENT_SINCE: Final[tuple[int, int]] = (1, 25)
"""Polars release that replaced ``collect(streaming=True)`` by ``collect(engine="streaming")``."""


@dataclass(frozen=True)
class HistorySource:
    """The history files of one directory: the final file, or the live/left-over parts."""

    directory: Path
    rank: int | None
    """The rank named by a ``rank-NNN`` directory; None for a plain (single-directory) run."""
    files: tuple[Path, ...]
    final: bool
    """True when ``files`` is the consolidated ``history.parquet``; False for parts."""


def _history_files(directory: Path) -> tuple[tuple[Path, ...], bool]:
    final = directory / HISTORY_FILE
    if final.is_file():
        return (final,), True
    # Published parts only, in part order: in-flight temporaries and other files are not parts.
    return tuple(list_parts(directory / HISTORY_PARTS)), False


def find_history_sources(output_dir: str | os.PathLike[str]) -> list[HistorySource]:
    """Every directory under ``output_dir`` holding history: ``rank-NNN/`` ones and the root.

    Directories without any history yet (a rank that wrote no chunk) are left out.
    """
    root = Path(output_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"output_dir {str(root)!r} is not a directory; pass the run's output_dir "
            "(the folder holding rank-NNN/ subfolders or history.parquet)"
        )
    sources: list[HistorySource] = []
    files, final = _history_files(root)
    if files:
        sources.append(HistorySource(root, None, files, final))
    for rank, child in list_rank_dirs(root):
        files, final = _history_files(child)
        if files:
            sources.append(HistorySource(child, rank, files, final))
    return sources


def _scan(source: HistorySource) -> pl.LazyFrame:
    # Plain strings, so that frames of different writers concatenate and compare alike. Every
    # ti.history file has the cast columns. Polars does not check Parquet page checksums:
    # each file is verified first (ti_io.integrity), once per process while unchanged.
    verify_files(source.files)
    return plain_strings(pl.scan_parquet([str(p) for p in source.files]))


def _scan_remote(location: RunLocation) -> pl.LazyFrame:
    # One listing of the whole prefix, every rank-NNN/ included (ti_io.read.remote).
    from ti_io.read.remote import list_run, scan_objects

    objects = list_run(location)
    frames = []
    for folder in ["", *(folder for _, folder in objects.rank_dirs())]:
        names, _ = objects.history(folder)
        if names:
            frames.append(plain_strings(scan_objects(objects, names)))
    if not frames:
        raise FileNotFoundError(
            f"no history found under output_dir {objects.uri()!r}: expected "
            f"{HISTORY_FILE} or {HISTORY_PARTS}/ parts in it or in its rank-NNN/ prefixes"
        )
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical")


def scan_ranks(output_dir: str | os.PathLike[str] | RunLocation) -> pl.LazyFrame:
    """One LazyFrame over every rank's ``ti.history`` rows under ``output_dir``.

    Reads ``rank-NNN/history.parquet`` of each rank, or, when the final file is absent (a live
    or killed rank), that rank's published parts (``history.parts/part-NNNNNN.parquet``, in part
    order); a plain single-directory run works too. Each row keeps the ``rank`` its writer
    recorded; nothing is combined across ranks.

    Every file is verified first (its Parquet page checksums, a row group at a time; Polars
    does not check them): a damaged file raises ``ti_io.DamagedFileError`` naming it, never
    wrong numbers. A file this process verified before, unchanged, is not read again. The
    query itself is lazy: Polars reads only the columns and row groups it needs. Raises
    ``FileNotFoundError`` naming ``output_dir`` when no history is found,
    ``ti_io.DamagedFileError`` for a damaged file.

    ``output_dir`` may be on object storage (``s3://bucket/run``, ``gs://...``, or a
    ``ti_io.RunLocation``): every rank's objects are found with one recursive listing of the
    prefix (a few list calls for hundreds of ranks), verified the same way and read through
    pyarrow's filesystem.
    """
    from ti_io.read.remote import local_path, remote_location

    remote = remote_location(output_dir)
    if remote is not None:
        return _scan_remote(remote)
    output_dir = local_path(output_dir)
    sources = find_history_sources(output_dir)
    if not sources:
        raise FileNotFoundError(
            f"no history found under output_dir {str(Path(output_dir))!r}: expected "
            f"{HISTORY_FILE} or {HISTORY_PARTS}/ parts in it or in its rank-NNN/ subfolders"
        )
    frames = [_scan(source) for source in sources]
    if len(frames) == 1:
        return frames[0]
    return pl.concat(frames, how="vertical")


def _polars_version() -> tuple[int, int]:
    numbers = re.findall(r"\d+", pl.__version__)[:2]
    return (int(numbers[0]), int(numbers[1])) if len(numbers) == 2 else (0, 0)


def collect_streaming(frame: pl.LazyFrame) -> pl.DataFrame:
    """Collect ``frame`` with Polars' streaming engine, for results built from more rows than fit
    in memory (for example a many-rank history reduced by a ``group_by``).

    Uses ``collect(engine="streaming")`` on Polars >= 1.25 and ``collect(streaming=True)`` on
    older 1.x releases, which knew only that spelling.
    """
    if _polars_version() >= _ENGINE_ARGUMENT_SINCE:
        return frame.collect(engine="streaming")
    legacy_collect: Any = frame.collect  # the 1.x-only keyword is absent from newer stubs
    return cast(pl.DataFrame, legacy_collect(streaming=True))
