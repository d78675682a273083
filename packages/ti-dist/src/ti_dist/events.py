"""Every rank's events (``ti.events``) of a run as one table, and which rank fired first.

With every rank writing (``rank_policy="all"``), each ``rank-NNN/`` holds its own
``events.parquet`` (or, live or killed, ``events.parts/``): ti-io's :func:`ti_io.read_events`
reads one. Here they are read together, each row keeping the ``rank`` its writer recorded, and
ordered by when the event happened in training: ``forward_index`` (the root forward it belongs
to; every rank runs the same forwards), then the events whose replay found the value came
from another rank (``replay`` ``from_another_rank``, contract 1.5) after the others of that
forward, then ``timestamp`` (the clocks of different hosts may disagree by milliseconds), then
``rank``. The first row is the rank that fired first: in a job where a NaN spreads through an
all-reduce, that is where to look.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from ti_io.read.events import concat_events, read_events
from ti_schema.layout import (
    EVENT_PARTS,
    EVENTS_FILE,
    HISTORY_FILE,
    HISTORY_PARTS,
    list_rank_dirs,
)

ORDER: tuple[str, ...] = ("forward_index", "timestamp", "rank", "event_id")
"""The order of :func:`events_across_ranks`: training order, then rank (within a forward, an
event whose value came from another rank after the others)."""
_ARRIVED = "__from_another_rank"


def _holds_run(directory: Path) -> bool:
    return any(
        (directory / name).exists()
        for name in (EVENTS_FILE, EVENT_PARTS, HISTORY_FILE, HISTORY_PARTS)
    )


def events_across_ranks(output_dir: str | os.PathLike[str]) -> pl.DataFrame:
    """Every event of every rank of the run in ``output_dir`` (``rank-NNN/`` directories, or a
    single-directory run), one row each with the ``ti.events`` columns, ordered by
    ``forward_index``, then those whose replay says ``from_another_rank`` last within it, then
    ``timestamp``, ``rank`` (the first row fired first). Empty (with the columns) when no rank
    had an event.

    Every file is verified first (``ti_io.DamagedFileError`` names a damaged one). Raises
    ``FileNotFoundError`` naming ``output_dir`` when it holds no run.
    """
    root = Path(output_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"events_across_ranks({str(root)!r}): no such directory; pass the run's output_dir "
            "(the folder holding rank-NNN/ subfolders or events.parquet)"
        )
    directories = [child for _, child in list_rank_dirs(root)]
    if _holds_run(root):
        directories.insert(0, root)
    if not directories:
        raise FileNotFoundError(
            f"no run found under output_dir {str(root)!r}: expected {EVENTS_FILE}, "
            f"{HISTORY_FILE} or their parts in it or in its rank-NNN/ subfolders"
        )
    table: pa.Table = concat_events([read_events(d) for d in directories])
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    arrived = (pl.col("replay") == "from_another_rank").fill_null(False).alias(_ARRIVED)
    order = [ORDER[0], _ARRIVED, *ORDER[1:]]
    return frame.with_columns(arrived).sort(order, maintain_order=True).drop(_ARRIVED)


def first_event(output_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The event that fired first across the ranks of the run in ``output_dir`` (the first
    row of :func:`events_across_ranks`: smallest ``forward_index``, then ``timestamp``, then
    ``rank``) as a dict of its ``ti.events`` columns; its ``rank`` says which rank it was.
    None when no rank had an event."""
    frame = events_across_ranks(output_dir)
    if not frame.height:
        return None
    return frame.row(0, named=True)


__all__ = ["ORDER", "events_across_ranks", "first_event"]
