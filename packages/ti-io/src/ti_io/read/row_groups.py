"""A run's history files read a row group at a time: the one streaming input of the readers.

Every reader that aggregates a whole history (``ti summary``, ``ti compare``, finalization's
statistics, ti-dist's cross-rank readers) reads it through :func:`read_row_groups`: each row
group of each file in order, only the columns asked for, string columns as dictionaries (their
indices, never one Python string per row), every page read checked against its checksum. So a
reader holds one or two row groups at a time (about 131,072 rows each in a finalized file)
whatever the length of the run, and a damaged file raises ``ti_io.DamagedFileError`` naming it
before any number from it is used. A helper thread reads the next row group while the caller
works on the current one (pyarrow decodes with the GIL released).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pyarrow as pa
import pyarrow.parquet as pq

from ti_io.integrity import open_verified, read_error, read_footer
from ti_schema import SchemaMismatchError, check_compatible
from ti_schema.layout import HISTORY_FILE, HISTORY_PARTS, list_parts

STRING_COLUMNS: Final[frozenset[str]] = frozenset(
    {
        "run_id",
        "layer",
        "module_type",
        "signal",
        "tensor_path",
        "mode",
        "dtype",
        "metric",
        "unavailable_reason",
    }
)
"""The ``ti.history`` columns read as dictionaries (repeated strings)."""
_AHEAD: Final[int] = 2
"""Row groups read ahead of the consumer."""


@dataclass(frozen=True)
class HistoryFiles:
    """The history files of one run directory, as the readers pick them: ``history.parquet``
    once finalized, else the published parts in part order (a live or interrupted run)."""

    paths: tuple[Path, ...]
    rows: tuple[int, ...]
    """Rows of each file, from its footer."""
    final: bool

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    def locate(self, row: int) -> tuple[int, int]:
        """``(file index, row in that file)`` of a row numbered across the files in order."""
        starts = list(itertools.accumulate(self.rows, initial=0))
        index = bisect.bisect_right(starts, row) - 1
        if row < 0 or index >= len(self.rows):
            raise IndexError(f"row {row} is outside the {self.total_rows} rows of the history")
        return index, row - starts[index]


def history_files(directory: Path) -> HistoryFiles:
    """The history files of the run ``directory`` (empty when it has none yet); footers are
    read for their row counts and contract version (``DamagedFileError`` for one that does not
    parse, :class:`UnreadableContractError` for one this reader cannot read)."""
    final = directory / HISTORY_FILE
    paths = [final] if final.is_file() else list_parts(directory / HISTORY_PARTS)
    rows = []
    for path in paths:
        metadata = read_footer(path)
        check_contract(path, metadata)
        rows.append(int(metadata.num_rows))
    return HistoryFiles(tuple(paths), tuple(rows), final.is_file())


class UnreadableContractError(SchemaMismatchError):
    """A history file of a contract this reader cannot read (another major: a newer ti wrote
    it); one line naming the file and what to upgrade."""

    def __init__(self, path: Path, error: SchemaMismatchError) -> None:
        super().__init__(error.subject, error.mismatches)
        problem = error.mismatches[0] if error.mismatches else error
        self.path = path
        self.args = (
            f"{path}: {problem} (pip install -U ti-schema ti-io installs the newest readers)",
        )

    def __str__(self) -> str:
        return str(self.args[0])


def check_contract(path: Path, metadata: pq.FileMetaData) -> None:
    """Raise :class:`UnreadableContractError` naming ``path`` when its ``ti`` footer names a
    contract this reader cannot read as ``ti.history`` (another major). A file without the
    footer (rewritten by a tool that drops metadata) is read as it is."""
    if b"ti" not in (metadata.metadata or {}):
        return
    try:
        check_compatible(metadata.metadata)
    except SchemaMismatchError as exc:
        raise UnreadableContractError(path, exc) from None


@dataclass(frozen=True)
class RowGroup:
    """One row group of one file, and where it starts in the stream of rows."""

    table: pa.Table
    path: Path
    start: int
    """The index of its first row among all rows of the files read, in order."""


def _open(path: Path, columns: Sequence[str] | None) -> pq.ParquetFile:
    present = pq.read_schema(path).names if columns is None else list(columns)
    strings = [name for name in present if name in STRING_COLUMNS]
    return open_verified(path, read_dictionary=strings)


def _read(
    source: pq.ParquetFile, path: Path, index: int, columns: Sequence[str] | None
) -> pa.Table:
    try:
        return source.read_row_group(index, columns=columns, use_threads=True)
    except (OSError, pa.ArrowException) as exc:
        if isinstance(exc, FileNotFoundError | PermissionError):
            raise
        raise read_error(path, exc) from None


def _plain(table: pa.Table) -> pa.Table:
    """``table`` with its dictionary columns decoded (a few rows, from row groups whose
    dictionaries differ, concatenate alike)."""
    return table.cast(
        pa.schema(
            f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f
            for f in table.schema
        )
    )


_DONE: Final = object()


def read_row_groups(
    paths: Sequence[Path], columns: Sequence[str] | None = None
) -> Iterator[RowGroup]:
    """Every row group of ``paths``, in order, with ``columns`` (None: all), strings as
    dictionaries, checksums verified; the next one is read ahead on a helper thread.

    Raises ``ti_io.DamagedFileError`` naming the file whose footer or page is damaged.
    """
    ahead: queue.Queue[object] = queue.Queue(maxsize=_AHEAD)
    stop = threading.Event()

    def produce() -> None:
        try:
            start = 0
            for path in paths:
                with _open(path, columns) as source:
                    for index in range(source.metadata.num_row_groups):
                        if stop.is_set():
                            return
                        table = _read(source, path, index, columns)
                        ahead.put(RowGroup(table, path, start))
                        start += table.num_rows
            ahead.put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            ahead.put(exc)

    reader = threading.Thread(target=produce, name="ti-io-read", daemon=True)
    reader.start()
    try:
        while True:
            item = ahead.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, RowGroup)
            yield item
    finally:
        stop.set()
        while reader.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                ahead.get(timeout=0.05)
        reader.join()


def read_rows(files: HistoryFiles, rows: Sequence[int], columns: Sequence[str]) -> pa.Table:
    """The rows numbered ``rows`` (across ``files`` in order) with ``columns``, in that order;
    only the row groups holding them are read."""
    wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}
    file_starts = list(itertools.accumulate(files.rows, initial=0))
    group_starts: dict[int, list[int]] = {}
    for position, row in enumerate(rows):
        file = bisect.bisect_right(file_starts, row) - 1
        offset = row - file_starts[file]
        if file not in group_starts:
            metadata = read_footer(files.paths[file])
            group_starts[file] = list(
                itertools.accumulate(
                    (metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)),
                    initial=0,
                )
            )
        bounds = group_starts[file]
        group = bisect.bisect_right(bounds, offset) - 1
        wanted.setdefault((file, group), []).append((position, offset - bounds[group]))
    pieces: list[pa.Table] = []
    order: list[int] = []
    for (file, group), picks in sorted(wanted.items()):
        path = files.paths[file]
        with _open(path, columns) as source:
            table = _read(source, path, group, columns)
        pieces.append(_plain(table.take([offset for _, offset in picks])))
        order += [position for position, _ in picks]
    if not pieces:
        return pa.table({name: pa.array([], pa.null()) for name in columns})
    taken = pa.concat_tables(pieces)
    inverse = [0] * len(order)
    for at, position in enumerate(order):
        inverse[position] = at
    return taken.take(inverse)


__all__ = [
    "STRING_COLUMNS",
    "HistoryFiles",
    "RowGroup",
    "UnreadableContractError",
    "check_contract",
    "history_files",
    "read_row_groups",
    "read_rows",
]
