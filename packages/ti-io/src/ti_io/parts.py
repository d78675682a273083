"""The background writer: publishes history and histogram chunks as Parquet parts.

Ownership: one ``PartWriter`` per open ``DirectorySink``; its single thread is the only writer
of ``history.parts/``, ``histograms.parts/`` and the sink's TensorBoard event file until
``stop``. The queue is bounded: when the disk is slower than training, ``submit_*`` blocks the
training thread (backpressure) instead of dropping rows or growing memory. A failed write is
recorded (path, cause, rows lost) and reported by ``take_errors``; the thread keeps serving
later chunks, so everything that can still be published is. A part whose publication fails
is written once more at once (:func:`publish_part`): a transient error loses nothing.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, TypeAlias, assert_never

import pyarrow as pa
import pyarrow.parquet as pq

from ti_io.encoding import (
    DictionaryCache,
    dictionary_columns,
    dictionary_schema,
    footer_metadata,
    plain_schema,
)
from ti_io.errors import ArtifactWriteError
from ti_io.publishing import publish_with
from ti_io.tensorboard_sink import EventFileHistograms
from ti_schema.layout import HISTOGRAM_PARTS, HISTORY_PARTS, part_name

PART_COMPRESSION: Final[str] = "lz4"
"""Parts are transient (consolidation rewrites them into the zstd-compressed final files), so
they are written for speed: LZ4 and no column statistics took about half the writer's CPU
time of zstd with statistics (benchmarks/README.md, issue 16)."""
Lost = Literal["history rows", "histogram rows", "TensorBoard histograms", "final artifacts"]
"""What a failed write cost, as the error message names it."""
Chunk = Literal["history", "histograms", "flush"]
"""What a queued item asks the writer to do."""
Item: TypeAlias = tuple[Chunk, list[pa.RecordBatch]] | None
"""A queued chunk, or None: publish what is pending and stop."""

QUEUE_CHUNKS: Final[int] = 3
"""Chunks that may wait for the writer before the training thread blocks."""


@dataclass(frozen=True)
class WriteFailure:
    """One failed write: where, why, and how many rows it cost."""

    path: Path
    cause: BaseException
    rows_lost: int
    what: Lost


def conform(batches: list[pa.RecordBatch], schema: pa.Schema) -> pa.Table:
    """One table of ``batches`` in exactly ``schema`` (dictionary strings decoded)."""
    tables = [_conformed(b, schema) for b in batches]
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def _conformed(batch: pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    # ti-core's batches already have the contract's fields (types, nullability, docs) and
    # differ at most in the schema's own metadata: relabelling them copies nothing, where
    # ``Table.cast`` runs one cast kernel per column, each releasing and re-taking the GIL
    # that the training thread needs (issue 16). Anything else is cast, which also refuses
    # nulls in a non-nullable column.
    table = pa.Table.from_batches([batch])
    same_fields = batch.schema.equals(schema.with_metadata(batch.schema.metadata or {}), True)
    if same_fields and not any(
        column.null_count
        for column, field in zip(table.columns, schema, strict=True)
        if not field.nullable
    ):
        return table.replace_schema_metadata(schema.metadata)
    return table.cast(schema)


def part_table(
    batches: list[pa.RecordBatch], schema: pa.Schema, cache: DictionaryCache
) -> pa.Table:
    """One part's rows: :func:`conform`'s table with its string columns dictionary-encoded
    (one dictionary per column), encoded through ``cache``."""
    table = conform(batches, schema)
    encoded = dictionary_schema(schema)
    columns = [
        pa.chunked_array([cache.encode(chunk) for chunk in column.chunks], field.type)
        if pa.types.is_dictionary(field.type)
        else column
        for column, field in zip(table.columns, encoded, strict=True)
    ]
    return pa.Table.from_arrays(columns, schema=encoded).unify_dictionaries()


def write_parquet(path: Path, table: pa.Table) -> None:
    """Publish ``table`` atomically at ``path``; dictionary-encoded string columns are stored
    as such and read back as the strings of :func:`~ti_io.encoding.plain_schema` (the footer
    records that schema)."""

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(
            tmp,
            table.schema.remove_metadata(),
            compression=PART_COMPRESSION,
            use_dictionary=dictionary_columns(table.schema),
            write_statistics=False,
            store_schema=False,  # the footer records the plain schema instead (below)
        ) as writer:
            writer.write_table(table)
            writer.add_key_value_metadata(footer_metadata(plain_schema(table.schema)))

    publish_with(path, write)


def publish_part(path: Path, table: pa.Table) -> None:
    """Publish a part; when that fails with an OSError, write it once more at once.

    The rows exist only in memory, so one retry (under a fresh temporary name) costs little
    and saves them from a transient error (EIO on a network file system, an interrupted
    rename). A lasting fault (a full or read-only disk) fails again, and the second error is
    raised.
    """
    try:
        write_parquet(path, table)
    except OSError:
        write_parquet(path, table)


class PartWriter:
    """A single background thread that publishes parts (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        history_schema: pa.Schema,
        histogram_schema: pa.Schema,
        *,
        histogram_part_rows: int,
        events: EventFileHistograms | None,
    ) -> None:
        self._history_dir = directory / HISTORY_PARTS
        self._histogram_dir = directory / HISTOGRAM_PARTS
        self._history_schema = history_schema
        self._histogram_schema = histogram_schema
        self._histogram_part_rows = histogram_part_rows
        self._events = events
        self._queue: queue.Queue[Item] = queue.Queue(QUEUE_CHUNKS)
        self._failures: list[WriteFailure] = []
        self._lock = threading.Lock()
        self._history_index = 0
        self._histogram_index = 0
        self._pending_histograms: list[pa.RecordBatch] = []
        self._pending_histogram_rows = 0
        self._dictionaries = DictionaryCache()
        self._thread = threading.Thread(target=self._run, name="ti-io-part-writer", daemon=True)
        self._thread.start()

    # -- training thread -------------------------------------------------------------------

    def submit_history(self, batches: list[pa.RecordBatch]) -> None:
        """Queue one chunk of history batches to become the next part (blocks when full)."""
        self._put(("history", batches))

    def submit_flush(self) -> None:
        """Queue publication of the pending histograms as a part."""
        self._put(("flush", []))

    def submit_histograms(self, batches: list[pa.RecordBatch]) -> None:
        """Queue histogram batches for TensorBoard and the next histogram part (blocks when
        full)."""
        self._put(("histograms", batches))

    def wait_idle(self) -> None:
        """Block until every queued chunk has been handled (published or recorded as failed)."""
        self._queue.join()

    def take_errors(self) -> list[WriteFailure]:
        """Failures since the last call (each reported once)."""
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def stop(self) -> None:
        """Publish what is queued and pending, close the event file, join the thread."""
        if self._thread.is_alive():
            self._put(None)
            self._thread.join()

    def _put(self, item: Item) -> None:
        while True:
            try:
                self._queue.put(item, timeout=1.0)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    raise ArtifactWriteError(
                        f"the ti-io writer thread for {self._history_dir.parent} has stopped; "
                        "rows are not being written"
                    ) from None

    # -- writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    self._flush_histograms()
                    self._close_events()
                    return
                self._handle(*item)
            finally:
                self._queue.task_done()

    def _handle(self, kind: Chunk, batches: list[pa.RecordBatch]) -> None:
        if kind == "history":
            self._write_history(batches)
            self._flush_histograms()
        elif kind == "flush":
            self._flush_histograms()
        elif kind == "histograms":
            self._write_events(batches)
            self._pending_histograms += batches
            self._pending_histogram_rows += sum(b.num_rows for b in batches)
            if self._pending_histogram_rows >= self._histogram_part_rows:
                self._flush_histograms()
        else:
            assert_never(kind)

    def _fail(self, path: Path, cause: BaseException, rows: int, what: Lost) -> None:
        with self._lock:
            self._failures.append(WriteFailure(path, cause, rows, what))

    def _write_history(self, batches: list[pa.RecordBatch]) -> None:
        path = self._history_dir / part_name(self._history_index)
        self._history_index += 1
        rows = sum(b.num_rows for b in batches)
        try:
            publish_part(path, part_table(batches, self._history_schema, self._dictionaries))
        except Exception as exc:  # recorded and reported on the training thread
            self._fail(path, exc, rows, "history rows")

    def _flush_histograms(self) -> None:
        if not self._pending_histograms:
            return
        batches, self._pending_histograms = self._pending_histograms, []
        rows, self._pending_histogram_rows = self._pending_histogram_rows, 0
        path = self._histogram_dir / part_name(self._histogram_index)
        self._histogram_index += 1
        try:
            publish_part(path, part_table(batches, self._histogram_schema, self._dictionaries))
        except Exception as exc:
            self._fail(path, exc, rows, "histogram rows")

    def _write_events(self, batches: list[pa.RecordBatch]) -> None:
        if self._events is None:
            return
        try:
            for batch in batches:
                self._events.write(batch)
            self._events.flush()
        except Exception as exc:
            rows = sum(b.num_rows for b in batches)
            self._fail(self._events.path, exc, rows, "TensorBoard histograms")

    def _close_events(self) -> None:
        if self._events is None:
            return
        try:
            self._events.close()
        except Exception as exc:
            self._fail(self._events.path, exc, 0, "TensorBoard histograms")
