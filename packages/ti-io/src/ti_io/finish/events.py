"""events.parquet: the run's ``ti.events`` parts as one file (finalization).

Written by the finalization step that writes the other final files (the journal's ``writing``,
:mod:`ti_io.finish.finalization`), before result.json and index.md, which list the events. Always
written: a run without events gets an empty table, not a missing file. Events are few, so the
parts are read whole (every page verified) and written as one zstd row group with page
checksums (:func:`ti_io.integrity.parquet_write_options`), published atomically.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ti_io.integrity import parquet_write_options
from ti_io.publishing import publish_with
from ti_io.read.events import concat_events, read_event_file
from ti_schema.layout import EVENT_PARTS, EVENTS_FILE, list_parts


def write_events_table(path: Path, table: pa.Table, compression: str) -> None:
    """Publish ``table`` (``ti.events``) at ``path`` atomically; its footer records the
    contract's schema and ``ti`` metadata."""

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, table.schema, **parquet_write_options(compression)) as writer:
            writer.write_table(table)

    publish_with(path, write)


def write_events_file(directory: Path, producer: str, compression: str) -> pa.Table:
    """``events.parquet`` from ``events.parts/`` (empty when there are none), in part order;
    returns the table written."""
    parts = list_parts(directory / EVENT_PARTS)
    table = concat_events([read_event_file(p) for p in parts], producer)
    write_events_table(directory / EVENTS_FILE, table, compression)
    return table


__all__ = ["write_events_file", "write_events_table"]
