"""The background writer: buffers history and histogram rows and publishes them as Parquet parts.

Ownership: one ``PartWriter`` per open ``DirectorySink``. The training thread (or the observer's
emission worker) only appends batches to the writer's buffers under its lock (:meth:`add`); the
writer's single thread is the only writer of ``history.parts/``, ``histograms.parts/`` and the
sink's TensorBoard event file until :meth:`stop`, and the only one that takes the buffers.

When it publishes (the batch-processor pattern: a size trigger and a time trigger on the
writer's own clock, never a next batch):

- ``delay`` seconds after the oldest buffered row arrived (``HistoryConfig.flush_seconds``), so
  every sample is readable within about that long and dense sampling makes at most one part
  per stream per ``delay``;
- as soon as ``history_part_rows`` history or ``histogram_part_rows`` histogram rows are
  buffered (the bound on memory);
- at :meth:`flush` (which waits for it) and at :meth:`stop`.

Each publication takes everything buffered: the histograms go to TensorBoard (written and
flushed) and into a histogram part, the history rows into a history part. Backpressure: while
the writer is still busy with the previous publication and a second full part has gathered,
:meth:`add` waits instead of dropping rows or growing memory, so the writer holds at most about
two parts' rows per stream. A failed write is recorded (path, cause, rows lost) and reported by
:meth:`take_errors`; the thread keeps serving later publications. A part whose publication
fails is written once more at once (:func:`publish_part`): a transient error loses nothing.
A forked child gets a fresh lock (it has no writer thread; the parent's may have held the lock
at the fork).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from ti_io.encoding import (
    DictionaryCache,
    arrow_footer_metadata,
    dictionary_columns,
    dictionary_schema,
    plain_schema,
)
from ti_io.errors import ArtifactWriteError
from ti_io.integrity import parquet_write_options
from ti_io.publishing import publish_with
from ti_io.storage import RunLocation
from ti_io.write.tensorboard_sink import EventFileHistograms, EventFileSequence
from ti_schema.layout import HISTOGRAM_PARTS, HISTORY_PARTS, part_name

PART_COMPRESSION: Final[str] = "lz4"
"""Parts are transient (consolidation rewrites them into the zstd-compressed final files), so
they are written for speed: LZ4 and no column statistics took about half the writer's CPU
time of zstd with statistics (benchmarks/README.md, "Sampled steps, `many` with the
directory sink: bigger parts, a time bound, LZ4")."""
Lost = Literal["history rows", "histogram rows", "TensorBoard histograms", "final artifacts"]
"""What a failed write cost, as the error message names it."""
Stream = Literal["history", "histograms"]
"""The two buffered streams."""

BACKPRESSURE_PARTS: Final[int] = 2
"""Full parts per stream that may be buffered before :meth:`PartWriter.add` waits."""
_LIVENESS_S: Final[float] = 1.0
"""How often a waiting caller checks that the writer thread is still alive."""


@dataclass(frozen=True)
class WriteFailure:
    """One failed write: where, why, and how many rows it cost."""

    path: Path | RunLocation
    cause: BaseException
    rows_lost: int
    what: Lost


class _Buffer:
    """One stream's buffered batches (guarded by the writer's lock)."""

    __slots__ = ("batches", "part_rows", "rows")

    def __init__(self, part_rows: int) -> None:
        self.part_rows = part_rows
        self.batches: list[pa.RecordBatch] = []
        self.rows = 0

    def take(self) -> list[pa.RecordBatch]:
        batches, self.batches, self.rows = self.batches, [], 0
        return batches

    @property
    def full(self) -> bool:
        return self.rows >= self.part_rows

    @property
    def overfull(self) -> bool:
        return self.rows >= BACKPRESSURE_PARTS * self.part_rows


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
    # that the training thread needs. Anything else is cast, which also refuses
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


def write_parquet(path: Path | RunLocation, table: pa.Table) -> None:
    """Publish ``table`` atomically at ``path``; dictionary-encoded string columns are stored
    as such and read back as the strings of :func:`~ti_io.encoding.plain_schema` (the footer
    records that schema)."""

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(
            tmp,
            table.schema.remove_metadata(),
            **parquet_write_options(PART_COMPRESSION),
            use_dictionary=dictionary_columns(table.schema),
            write_statistics=False,
            store_schema=False,  # the footer records the plain schema instead (below)
        ) as writer:
            writer.write_table(table)
            writer.add_key_value_metadata(arrow_footer_metadata(plain_schema(table.schema)))

    publish_with(path, write)


def publish_part(path: Path | RunLocation, table: pa.Table) -> None:
    """Publish a part; when that fails with an OSError, write it once more at once.

    The rows exist only in memory, so one retry (under a fresh temporary name) costs little
    and saves them from a transient error (EIO on a network file system, an interrupted
    rename; a dropped connection to an object store). A lasting fault (a full or read-only
    disk, a refused credential) fails again, and the second error is raised.
    """
    try:
        write_parquet(path, table)
    except OSError:
        write_parquet(path, table)


class PartWriter:
    """Buffers and publishes one run's parts on a single background thread (see the module
    docstring)."""

    def __init__(
        self,
        directory: Path | RunLocation,
        history_schema: pa.Schema,
        histogram_schema: pa.Schema,
        *,
        history_part_rows: int,
        histogram_part_rows: int,
        delay: float | None,
        events: EventFileHistograms | EventFileSequence | None,
        scalar_layers: frozenset[str] = frozenset(),
    ) -> None:
        self._directory = directory
        self._scalar_layers = scalar_layers
        """The layers whose history rows also go to TensorBoard as scalars (none: off)."""
        self._history_dir = directory / HISTORY_PARTS
        self._histogram_dir = directory / HISTOGRAM_PARTS
        self._history_schema = history_schema
        self._histogram_schema = histogram_schema
        self._delay = delay
        self._events = events
        self._cond = threading.Condition()
        # Guarded by _cond: the buffers, the clock of the oldest buffered row, flush requests.
        self._buffers: dict[Stream, _Buffer] = {
            "history": _Buffer(history_part_rows),
            "histograms": _Buffer(histogram_part_rows),
        }
        self._oldest: float | None = None
        self._requested = 0  # flushes asked for
        self._served = 0  # flushes whose rows are published (or recorded as failed)
        self._busy = False  # the writer is publishing what it took
        self._stopping = False
        # Writer thread only.
        self._failures: list[WriteFailure] = []
        self._failures_lock = threading.Lock()
        self._history_index = 0
        self._histogram_index = 0
        self._dictionaries = DictionaryCache()
        self._thread = threading.Thread(target=self._run, name="ti-io-part-writer", daemon=True)
        self._thread.start()
        _live.add(self)

    def _reset_in_child(self) -> None:
        # A forked child (a DataLoader worker) has no writer thread, and the writer's lock may
        # have been held at the fork: a fresh one, so nothing in the child can hang on it.
        self._cond = threading.Condition()

    # -- training thread -------------------------------------------------------------------

    def add(self, stream: Stream, batch: pa.RecordBatch) -> None:
        """Buffer ``batch``; wake the writer only when this starts the clock or fills a part
        (waking it per batch cost the training thread more than the buffering). Waits while
        the writer is behind (backpressure)."""
        with self._cond:
            buffer = self._buffers[stream]
            buffer.batches.append(batch)
            buffer.rows += batch.num_rows
            wake = buffer.full
            if self._oldest is None:
                self._oldest = time.monotonic()
                wake = wake or self._delay is not None
            if wake:
                self._cond.notify_all()
            if buffer.overfull:
                self._wait_for_room(buffer)

    def _wait_for_room(self, buffer: _Buffer) -> None:
        """Block (under ``_cond``) until the writer has taken ``buffer``'s rows."""
        while buffer.overfull:
            self._require_thread()
            self._cond.wait(_LIVENESS_S)

    def flush(self) -> None:
        """Publish everything buffered now and return once it is published (or failed)."""
        with self._cond:
            self._requested += 1
            ticket = self._requested
            self._cond.notify_all()
            while self._served < ticket:
                self._require_thread()
                self._cond.wait(_LIVENESS_S)

    def publish_soon(self) -> None:
        """Ask the writer to publish everything buffered now, without waiting for it (an event
        arrived: the rows before it should not wait for the clock)."""
        with self._cond:
            self._requested += 1
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until the writer has published everything that is due now (not what is still
        waiting for its delay)."""
        with self._cond:
            while self._busy or self._due(time.monotonic()):
                self._require_thread()
                self._cond.wait(_LIVENESS_S)

    def take_errors(self) -> list[WriteFailure]:
        """Failures since the last call (each reported once)."""
        with self._failures_lock:
            failures, self._failures = self._failures, []
        return failures

    def stop(self) -> None:
        """Publish everything buffered, close the event file, join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _require_thread(self) -> None:
        if not self._thread.is_alive():
            raise ArtifactWriteError(
                f"the ti-io writer thread for {self._directory} has stopped; "
                "rows are not being written"
            )

    # -- writer thread ---------------------------------------------------------------------

    def _due(self, now: float) -> bool:
        """Whether a publication is due (call under ``_cond``)."""
        if self._stopping or self._requested > self._served:
            return True
        if any(buffer.full for buffer in self._buffers.values()):
            return True
        return (
            self._delay is not None
            and self._oldest is not None
            and now - self._oldest >= self._delay
        )

    def _timeout(self, now: float) -> float | None:
        """Seconds until the delay makes a publication due; None: only a wake-up can."""
        if self._delay is None or self._oldest is None:
            return None
        return max(0.0, self._oldest + self._delay - now)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                while not self._due(now):
                    self._cond.wait(self._timeout(now))
                    now = time.monotonic()
                ticket, stopping = self._requested, self._stopping
                history = self._buffers["history"].take()
                histograms = self._buffers["histograms"].take()
                self._oldest = None
                self._busy = True
                self._cond.notify_all()  # room again for a producer waiting in add()
            try:
                self._publish(history, histograms)
                if stopping:
                    self._close_events()
            finally:
                del history, histograms
                with self._cond:
                    self._busy = False
                    self._served = max(self._served, ticket)
                    self._cond.notify_all()
            if stopping:
                return

    def _publish(self, history: list[pa.RecordBatch], histograms: list[pa.RecordBatch]) -> None:
        """Write one publication: TensorBoard events, then the history and histogram parts."""
        if histograms or (history and self._scalar_layers):
            self._write_events(histograms, history)
        if history:
            self._write_part("history", history)
        if histograms:
            self._write_part("histograms", histograms)

    def _fail(self, path: Path | RunLocation, cause: BaseException, rows: int, what: Lost) -> None:
        with self._failures_lock:
            self._failures.append(WriteFailure(path, cause, rows, what))

    def _write_part(self, stream: Stream, batches: list[pa.RecordBatch]) -> None:
        lost: Lost
        if stream == "history":
            path = self._history_dir / part_name(self._history_index)
            self._history_index += 1
            schema, lost = self._history_schema, "history rows"
        else:
            path = self._histogram_dir / part_name(self._histogram_index)
            self._histogram_index += 1
            schema, lost = self._histogram_schema, "histogram rows"
        try:
            publish_part(path, part_table(batches, schema, self._dictionaries))
        except Exception as exc:  # recorded and reported on the training thread
            self._fail(path, exc, sum(b.num_rows for b in batches), lost)

    def _write_events(
        self, batches: list[pa.RecordBatch], history: list[pa.RecordBatch] | None = None
    ) -> None:
        if self._events is None:
            return
        try:
            for batch in batches:
                self._events.write(batch)
            if self._scalar_layers:
                for batch in history or ():
                    self._events.write_scalars(batch, self._scalar_layers)
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


_live: weakref.WeakSet[PartWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_live):
        writer._reset_in_child()


if hasattr(os, "register_at_fork"):  # POSIX; spawned processes start clean anyway
    os.register_at_fork(after_in_child=_after_fork_in_child)
