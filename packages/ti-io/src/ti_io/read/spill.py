"""Rows routed by measurement into partitions, on disk when the history is long.

The exact aggregates of a history (quartiles, medians, window means) need every value of a
measurement at once, and no engine available computes them in bounded memory (DuckDB's
``quantile_cont`` and Polars' ``quantile`` hold every value of every group: 2.1 GB for a
216M-row history; their spilling alternatives, sorts and window functions, are ten times slower:
benchmarks/README.md, "Reading at scale"). So the readers partition first, by measurement: a
streaming pass writes each row's compact columns (measurement id, sample id, value...) to one of
``count`` partitions, each an Arrow IPC file in a private temporary directory, and then each
partition is aggregated whole, in memory, with Polars. A measurement lies in exactly one
partition, so the aggregates are exact; memory holds one partition (about
:data:`PARTITION_ROWS` rows) plus small write buffers, however long the history.

A history short enough for one partition stays in memory and nothing is written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa

PARTITION_ROWS: Final[int] = 4_000_000
"""Rows per partition aimed at by default: one partition in memory with its aggregation stays
near 300 MB (benchmarks/reading.py measures it)."""
PARTITION_ROWS_VARIABLE: Final[str] = "TI_IO_PARTITION_ROWS"
"""The environment variable that overrides :data:`PARTITION_ROWS` (a machine with little
memory lowers it; more, smaller partitions cost a little time)."""
MIN_PARTITION_ROWS: Final[int] = 1_000


def partition_rows() -> int:
    """Rows per partition: :data:`PARTITION_ROWS_VARIABLE` when set, else
    :data:`PARTITION_ROWS`. Raises ValueError naming the variable for a value that is not a
    whole number >= :data:`MIN_PARTITION_ROWS`."""
    text = os.environ.get(PARTITION_ROWS_VARIABLE, "").strip()
    if not text:
        return PARTITION_ROWS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < MIN_PARTITION_ROWS:
        raise ValueError(
            f"{PARTITION_ROWS_VARIABLE}={text!r}: rows per partition must be a whole number >= "
            f"{MIN_PARTITION_ROWS}, e.g. {PARTITION_ROWS_VARIABLE}=1000000 (or unset it)"
        )
    return value


BUFFER_BYTES: Final[int] = 32 << 20
"""Rows waiting to be written, across all partitions, are flushed before they take more."""
MIN_BUFFER_ROWS: Final[int] = 4096


def partition_count(rows: int) -> int:
    """The partitions for a history of ``rows`` rows (at least one; :func:`partition_rows`
    each)."""
    return max(1, -(-rows // partition_rows()))


class Partitions:
    """Rows of ``schema`` (its first column the measurement id, ``key``, UInt32) routed by
    ``key`` into ``count`` partitions; a context manager that removes its files on exit.

    Add rows with :meth:`add` (record batches of ``schema``; nulls are kept), then read each
    partition back with :meth:`frames` (one Polars DataFrame at a time, in partition order).
    ``directory``: where the private temporary directory goes (None: the system's,
    ``TMPDIR``).
    """

    def __init__(self, schema: pa.Schema, count: int, directory: Path | None = None) -> None:
        if schema.names[0] != "key" or schema.field(0).type != pa.uint32():
            raise ValueError(f"the first column must be 'key' (uint32), got {schema}")
        self._schema = schema
        self._count = max(1, count)
        self._root: Path | None = None
        self._directory = directory
        self._buffers: list[list[pa.RecordBatch]] = [[] for _ in range(self._count)]
        self._buffered = [0] * self._count
        self._written: set[int] = set()
        self._writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
        row_bytes = sum(_width(f.type) for f in schema)
        self._flush_rows = max(MIN_BUFFER_ROWS, BUFFER_BYTES // (row_bytes * self._count))
        self.rows = 0

    @property
    def count(self) -> int:
        return self._count

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    def __enter__(self) -> Partitions:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close and remove every partition file (idempotent)."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self._buffers = [[] for _ in range(self._count)]
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def add(self, batch: pa.RecordBatch, parts: npt.NDArray[np.integer[Any]] | None = None) -> None:
        """Rows of the schema (``batch.column(0)``: their measurement ids), each to partition
        ``key % count``, or to ``parts[i]`` when given (a reader that partitions by something
        else, such as ranges of sample ids)."""
        rows = batch.num_rows
        if not rows:
            return
        self.rows += rows
        if self._count == 1:
            self._buffers[0].append(batch)
            return
        if parts is None:
            parts = batch.column(0).to_numpy() % self._count
        part = parts.astype(np.uint16 if self._count < 1 << 16 else np.uint32)
        order = np.argsort(part, kind="stable")
        bounds = np.concatenate(([0], np.cumsum(np.bincount(part, minlength=self._count))))
        ordered = batch.take(pa.array(order))
        for index in np.flatnonzero(np.diff(bounds)).tolist():
            start, end = int(bounds[index]), int(bounds[index + 1])
            self._buffers[index].append(ordered.slice(start, end - start))
            self._buffered[index] += end - start
            if self._buffered[index] >= self._flush_rows:
                self._flush(index)

    def _flush(self, index: int) -> None:
        pieces = self._buffers[index]
        if not pieces:
            return
        writer = self._writers.get(index)
        if writer is None:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="ti-partitions-", dir=self._directory))
            writer = pa.ipc.new_file(str(self._path(index)), self._schema)
            self._writers[index] = writer
            self._written.add(index)
        writer.write_table(pa.Table.from_batches(pieces, self._schema).combine_chunks())
        self._buffers[index] = []
        self._buffered[index] = 0

    def _path(self, index: int) -> Path:
        assert self._root is not None
        return self._root / f"{index:05d}.arrow"

    def frames(self) -> Iterator[pl.DataFrame]:
        """Each non-empty partition as one DataFrame, in partition order; each read only when
        asked for, so one is in memory at a time."""
        if self._count == 1:
            pieces, self._buffers[0] = self._buffers[0], []
            if pieces:
                yield _frame(pa.Table.from_batches(pieces, self._schema))
            return
        for index in range(self._count):
            self._flush(index)
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
        for index in sorted(self._written):
            path = self._path(index)
            # Mapped, not copied: the frame's buffers are the file's pages (unlinking the file
            # keeps them until the frame is gone).
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_file(source).read_all()
            path.unlink()
            yield _frame(table)
            del table


def _width(kind: pa.DataType) -> int:
    """Bytes a value of ``kind`` takes about (a list or string: a guess of 32)."""
    try:
        return max(int(kind.bit_width) // 8, 1)
    except ValueError:  # not a fixed-width type
        return 32


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


__all__ = [
    "PARTITION_ROWS",
    "PARTITION_ROWS_VARIABLE",
    "Partitions",
    "partition_count",
    "partition_rows",
]
