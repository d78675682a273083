"""Event parts: each ``ti.events`` batch published at once as its own part.

An event (a NaN first seen, a capture asked for, a loss spike) is rare and urgent: the process
may die right after it. So :class:`EventPartWriter` does not buffer: the thread that hands the
batch over (the one that detected the event) checks it against the contract and publishes it
as ``events.parts/part-NNNNNN.parquet`` before returning, atomically and durably (temporary
file, fsync, rename, fsync of the directory; :func:`ti_io.write.parts.publish_part`, which
also writes a failed part once more). A ``kill -9`` after the call returns loses nothing.
Finalization streams the parts into ``events.parquet`` (:mod:`ti_io.finish.events`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Final

import pyarrow as pa

from ti_io.errors import ArtifactWriteError
from ti_io.storage import RunLocation
from ti_io.write.parts import conform, publish_part
from ti_schema import SchemaMismatchError, validate_events
from ti_schema.layout import EVENT_PARTS, list_parts, part_name

_STRING: Final[pa.DataType] = pa.string()


def check_events_batch(batch: pa.RecordBatch, expected: pa.Schema) -> None:
    """Refuse a batch that is not ``ti.events`` data: ValueError naming the argument, what
    is wrong and how to build a conforming batch."""
    if not isinstance(batch, pa.RecordBatch):
        raise TypeError(
            "DirectorySink.write_events(batch) takes a pyarrow.RecordBatch built with "
            f"ti_schema.events_schema(), got {type(batch).__name__}"
        )
    if batch.schema.names != expected.names:
        raise ValueError(
            f"DirectorySink.write_events: batch columns {batch.schema.names} differ from the "
            f"contract's {expected.names}; build batches with ti_schema.events_schema()"
        )
    for field, want in zip(batch.schema, expected, strict=True):
        typ = field.type
        if typ == want.type or (
            want.type == _STRING and pa.types.is_dictionary(typ) and typ.value_type == _STRING
        ):
            continue
        raise ValueError(
            f"DirectorySink.write_events: column {field.name!r} has type {typ}; the contract "
            f"(ti_schema.events_schema()) says {want.type}"
        )
    try:
        # The data rules (kinds, signals, a nonfinite event's first module, paired lists); the
        # schema's own nullability flags are not the point here (conform() casts them).
        validate_events(batch, metadata=expected.metadata, nullability="data")
    except SchemaMismatchError as error:
        raise ValueError(
            f"DirectorySink.write_events: the batch breaks ti.events: {error}"
        ) from None


class EventPartWriter:
    """Publishes one run's event parts, one per batch, on the caller's thread (thread-safe)."""

    def __init__(self, directory: Path | RunLocation, schema: pa.Schema) -> None:
        self._directory = directory
        self._dir = directory / EVENT_PARTS
        self._schema = schema
        self._lock = threading.Lock()
        # A fresh run: 0 (an object-store prefix was checked empty of a run at open).
        self._next = len(list_parts(self._dir)) if isinstance(self._dir, Path) else 0

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    def write(self, batch: pa.RecordBatch) -> None:
        """Check ``batch`` and publish it as the next part before returning.

        Raises ValueError/TypeError for a batch that breaks the contract (nothing written) and
        ArtifactWriteError when the part cannot be published (after one retry).
        """
        check_events_batch(batch, self._schema)
        if not batch.num_rows:
            return
        table = conform([batch], self._schema)
        with self._lock:  # events may come from the training thread and a backward thread
            path = self._dir / part_name(self._next)
            self._next += 1
            try:
                publish_part(path, table)
            except Exception as exc:
                raise ArtifactWriteError(
                    f"could not write {path}: {type(exc).__name__}: {exc}; lost "
                    f"{batch.num_rows} event row(s). Everything already published in "
                    f"{self._directory} stays readable.",
                    paths=(str(path),),
                    rows_lost=batch.num_rows,
                ) from exc


__all__ = ["EventPartWriter", "check_events_batch"]
