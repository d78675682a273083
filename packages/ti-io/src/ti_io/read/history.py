"""Reading a run directory back: ``scan_history`` over the final file or the live parts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from ti_io.integrity import verify_files
from ti_io.read.row_groups import HistoryFiles, history_files
from ti_schema import history_schema
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, list_parts, list_rank_dirs

if TYPE_CHECKING:
    from ti_io.storage import RunLocation


def _empty_history() -> pl.LazyFrame:
    frame = pl.from_arrow(history_schema().empty_table())
    assert isinstance(frame, pl.DataFrame)
    return frame.lazy()


def _rank_private(where: str, ranks: list[str], first: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{where} holds rank-private runs ({', '.join(ranks[:4])}"
        f"{', ...' if len(ranks) > 4 else ''}); read them together with "
        f"ti_dist.scan_ranks(output_dir), or one rank with scan_history({first!r})"
    )


def _scan_remote(location: RunLocation) -> pl.LazyFrame:
    from ti_io.read.remote import list_run, scan_objects

    objects = list_run(location)
    names, _ = objects.history()
    if names:
        return scan_objects(objects, names)
    if objects.is_dir(HISTORY_PARTS):
        return _empty_history()
    ranks = [folder for _, folder in objects.rank_dirs()]
    if ranks:
        raise _rank_private(objects.uri(), ranks, objects.uri(ranks[0]))
    raise FileNotFoundError(
        f"{objects.uri()} holds no history: neither {HISTORY_FILE} nor {HISTORY_PARTS}/ is there"
    )


def scan_history(output_dir: str | os.PathLike[str] | RunLocation) -> pl.LazyFrame:
    """A Polars LazyFrame over a run's history (``ti.history`` rows).

    Reads ``history.parquet`` once the run is finalized, else the parts published so far in
    ``history.parts/`` (a live or interrupted run; parts appear atomically, so every one read
    is complete). Order by ``sample_id`` for trends. For rank-private runs (``rank-NNN/``)
    use ``ti_dist.scan_ranks``.

    Every file is verified first (its page checksums, a row group at a time: Polars does not
    check them), so a damaged file raises ``ti_io.DamagedFileError`` naming it instead of
    reading wrong numbers; a file verified before in this process, unchanged, is not read
    again. Files written without checksums (before ti-io wrote them) are read unverified.

    ``output_dir`` may be a run on object storage: a URI (``s3://bucket/run``, ``gs://...``;
    credentials and endpoint from the standard places) or a ``ti_io.RunLocation``. Its objects
    are found with one listing, verified the same way and read through pyarrow's filesystem.
    """
    from ti_io.read.remote import local_path, remote_location

    remote = remote_location(output_dir)
    if remote is not None:
        return _scan_remote(remote)
    directory = local_path(output_dir)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"scan_history({str(directory)!r}): no such directory; pass a run's output_dir"
        )
    _check_holds_history(directory)
    final = directory / HISTORY_FILE
    if final.is_file():
        verify_files([final])
        return pl.scan_parquet(final)
    parts = list_parts(directory / HISTORY_PARTS)
    if parts:
        verify_files(parts)
        return pl.scan_parquet([str(p) for p in parts])
    # A live run that has not published its first part yet: an empty, typed frame.
    return _empty_history()


def _check_holds_history(directory: Path) -> None:
    """Raise FileNotFoundError saying why when ``directory`` (a local directory) holds no
    history: rank-private runs beneath it, or nothing."""
    if (directory / HISTORY_FILE).is_file() or (directory / HISTORY_PARTS).is_dir():
        return
    ranks = [child.name for _, child in list_rank_dirs(directory)]
    if ranks:
        raise _rank_private(str(directory), ranks, str(directory / ranks[0]))
    raise FileNotFoundError(
        f"{directory} holds no history: neither {HISTORY_FILE} nor {HISTORY_PARTS}/ is there"
    )


def history_files_of(directory: Path) -> HistoryFiles:
    """The history files of the local run ``directory``, as :func:`scan_history` picks them
    (:func:`ti_io.read.row_groups.history_files`: none yet for a live run that has published
    no part). Raises FileNotFoundError naming what is missing, as :func:`scan_history` does."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory; pass a run's output_dir")
    _check_holds_history(directory)
    return history_files(directory)
