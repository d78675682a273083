"""Reading a run directory back: ``scan_history`` over the final file or the live parts."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl

from ti_io.integrity import verify_files
from ti_schema import history_schema
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, list_parts, list_rank_dirs


def scan_history(output_dir: str | os.PathLike[str]) -> pl.LazyFrame:
    """A Polars LazyFrame over a run's history (``ti.history`` rows).

    Reads ``history.parquet`` once the run is finalized, else the parts published so far in
    ``history.parts/`` (a live or interrupted run; parts appear atomically, so every one read
    is complete). Order by ``sample_id`` for trends. For rank-private runs (``rank-NNN/``)
    use ``ti_dist.scan_ranks``.

    Every file is verified first (its page checksums, a row group at a time: Polars does not
    check them), so a damaged file raises ``ti_io.DamagedFileError`` naming it instead of
    reading wrong numbers; a file verified before in this process, unchanged, is not read
    again. Files written without checksums (before ti-io wrote them) are read unverified.
    """
    directory = Path(output_dir)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"scan_history({str(directory)!r}): no such directory; pass a run's output_dir"
        )
    final = directory / HISTORY_FILE
    if final.is_file():
        verify_files([final])
        return pl.scan_parquet(final)
    parts = list_parts(directory / HISTORY_PARTS)
    if parts:
        verify_files(parts)
        return pl.scan_parquet([str(p) for p in parts])
    if (directory / HISTORY_PARTS).is_dir():
        # A live run that has not published its first part yet: an empty, typed frame.
        frame = pl.from_arrow(history_schema().empty_table())
        assert isinstance(frame, pl.DataFrame)
        return frame.lazy()
    ranks = [child.name for _, child in list_rank_dirs(directory)]
    if ranks:
        raise FileNotFoundError(
            f"{directory} holds rank-private runs ({', '.join(ranks[:4])}"
            f"{', ...' if len(ranks) > 4 else ''}); read them together with "
            "ti_dist.scan_ranks(output_dir), or one rank with "
            f"scan_history({str(directory / ranks[0])!r})"
        )
    raise FileNotFoundError(
        f"{directory} holds no history: neither {HISTORY_FILE} nor {HISTORY_PARTS}/ is there"
    )
