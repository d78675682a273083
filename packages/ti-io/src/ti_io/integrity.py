"""Parquet integrity: every file ti writes carries page checksums, every read ti does verifies.

One place for both sides, so every writer (parts, the final files, upgrades, the events table)
and every reader agrees:

- :func:`parquet_write_options`: the ``pyarrow.parquet.ParquetWriter`` keywords of every file
  (its compression and ``write_page_checksum=True``: a CRC-32 in each page header).
- :func:`open_verified`: a ``ParquetFile`` whose every page read is checked against its
  checksum; a footer that does not parse raises :class:`DamagedFileError` naming the file.
- :func:`verify_parquet` / :func:`verify_files`: read every page of a file once, a row group
  at a time (bounded memory), before a reader that does not verify checksums (Polars) scans
  it; a verified file is remembered (by inode, size and modification time) for the process.
- :func:`parquet_problem`: what is wrong with a file, in words (``ti validate``).
- :func:`verify_objects`: the same verification for objects of a run on another filesystem
  (object storage, :mod:`ti_io.read.remote`), named by their URIs.

A flipped bit in a page is then an error naming the file and the page instead of a wrong
number. Files written before checksums (no CRC in their page headers) are read as before;
:attr:`Verification.checksummed` is False for them, and ``ti validate`` says they cannot be
verified. Pure pyarrow: the writing side imports this without Polars.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import pyarrow.fs as pafs

PAGE_CHECKSUMS: Final[bool] = True
"""Every Parquet file ti writes has a CRC-32 in each page header."""
_MAGIC: Final[bytes] = b"PAR1"
_VERIFIED_CACHE: Final[int] = 4096
"""Files remembered as verified (per process)."""
WHOLE_OBJECT_BYTES: Final[int] = 64 << 20
"""Objects up to this size are verified from one read of the whole object (one request
instead of one per footer and row group); larger ones a row group at a time."""


class DamagedFileError(ValueError):
    """A Parquet file of a run is damaged: truncated, its footer does not parse, or a page
    fails its checksum or cannot be decoded. ``path`` is the file (a URI for an object of a run
    on object storage), ``problem`` what is wrong."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path} is damaged: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class Verification:
    """What verifying one file found (it was readable)."""

    path: Path | str
    """The file; for an object on another filesystem, its URI."""
    rows: int
    checksummed: bool
    """False for a file written without page checksums (before ti-io wrote them): it was
    read, but a flipped bit in it cannot be detected."""


def parquet_write_options(compression: str) -> dict[str, Any]:
    """The ``ParquetWriter`` keywords every ti file is written with: ``compression`` and
    page checksums."""
    return {"compression": compression, "write_page_checksum": PAGE_CHECKSUMS}


def _footer_problem(path: Path, exc: BaseException) -> str:
    """Why the footer of ``path`` cannot be read, in words."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            return _unreadable_footer(f, size, exc)
    except OSError:
        return f"it cannot be read ({exc})"


def _unreadable_footer(f: IO[bytes] | pa.NativeFile, size: int, exc: BaseException) -> str:
    """Why the footer of the ``size`` bytes open as ``f`` cannot be read, in words."""
    head = f.read(4)
    f.seek(max(size - 4, 0))
    tail = f.read(4)
    f.seek(0)
    zeros = size > 0 and not f.read(1 << 20).strip(b"\0")
    if size == 0:
        return "it is empty (0 bytes)"
    if zeros and head != _MAGIC:
        return f"it holds only zero bytes ({size} bytes): its content was lost"
    if tail != _MAGIC:
        return (
            f"it is truncated or lost its footer ({size} bytes, not ending with Parquet's "
            f"{_MAGIC.decode()} marker)"
        )
    return f"its footer does not parse ({exc})"


def read_footer(path: Path) -> pq.FileMetaData:
    """The footer of ``path``; DamagedFileError naming what is wrong when it cannot be read
    (OSError when the file cannot be opened at all)."""
    try:
        return pq.read_metadata(path)
    except (pa.ArrowInvalid, pa.ArrowIOError) as exc:
        if isinstance(exc, FileNotFoundError | PermissionError):
            raise
        raise DamagedFileError(path, _footer_problem(path, exc)) from None


def parquet_rows(path: Path) -> int:
    """Rows the footer of ``path`` records (DamagedFileError when it cannot be read)."""
    return int(read_footer(path).num_rows)


def open_verified(path: Path, **kwargs: Any) -> pq.ParquetFile:
    """``pq.ParquetFile(path, page_checksum_verification=True, **kwargs)``: every page read
    from it is checked against its checksum. DamagedFileError when its footer cannot be read;
    reads of damaged pages raise OSError (see :func:`read_error`)."""
    try:
        return pq.ParquetFile(path, page_checksum_verification=True, **kwargs)
    except (pa.ArrowInvalid, pa.ArrowIOError) as exc:
        if isinstance(exc, FileNotFoundError | PermissionError):
            raise
        raise DamagedFileError(path, _footer_problem(path, exc)) from None


def read_error(path: Path, exc: BaseException) -> DamagedFileError:
    """The DamagedFileError for a page of ``path`` that failed to read with ``exc``."""
    return read_error_named(path, exc)


def read_error_named(path: Path | str, exc: BaseException) -> DamagedFileError:
    """:func:`read_error` for a file named by a path or a URI."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "checksum" in text.lower():
        return DamagedFileError(path, f"a page fails its checksum ({text}): its data is damaged")
    return DamagedFileError(path, f"a page cannot be decoded ({text}): its data is damaged")


def _has_crc(path: Path, metadata: pq.FileMetaData) -> bool:
    """Whether the first page header of ``path`` carries a CRC (field 4 of Parquet's
    ``PageHeader``, Thrift compact protocol: fields 1-3 are i32s, each one byte ``0x15``
    and a varint; a CRC follows as ``0x15`` again)."""
    with path.open("rb") as f:
        return _first_page_has_crc(f, metadata)


def _first_page_has_crc(f: IO[bytes] | pa.NativeFile, metadata: pq.FileMetaData) -> bool:
    """:func:`_has_crc` of the file open as ``f``."""
    if metadata.num_row_groups == 0 or metadata.num_columns == 0:
        return True  # no page to verify
    column = metadata.row_group(0).column(0)
    offset = column.dictionary_page_offset if column.has_dictionary_page else None
    if offset is None or offset <= 0:
        offset = column.data_page_offset
    f.seek(offset)
    header = f.read(64)
    at = 0
    for _ in range(3):  # type, uncompressed_page_size, compressed_page_size
        if at >= len(header) or header[at] != 0x15:
            return False
        at += 1
        while at < len(header) and header[at] & 0x80:
            at += 1
        at += 1
    return at < len(header) and header[at] == 0x15


def has_page_checksums(path: Path, metadata: pq.FileMetaData) -> bool:
    """Whether the pages of ``path`` (its footer ``metadata``) carry checksums (False for a
    file written before ti-io wrote them)."""
    return _has_crc(path, metadata)


def verify_parquet(path: Path) -> Verification:
    """Read every page of ``path`` once, a row group at a time, checking page checksums.

    Raises DamagedFileError naming what is wrong (truncated, footer, checksum, undecodable
    page); OSError when the file cannot be opened at all.
    """
    source = open_verified(path)
    with source:
        metadata = source.metadata
        try:
            checksummed = _has_crc(path, metadata)
            for index in range(metadata.num_row_groups):
                source.read_row_group(index, use_threads=True)
        except (OSError, pa.ArrowException) as exc:
            if isinstance(exc, FileNotFoundError | PermissionError):
                raise
            raise read_error(path, exc) from None
    return Verification(path, int(metadata.num_rows), checksummed)


def object_footer(filesystem: pafs.FileSystem, path: str, name: str) -> pq.FileMetaData:
    """:func:`read_footer` for the object ``path`` of ``filesystem`` (``name``, its URI, names
    it in errors): DamagedFileError when the footer cannot be read, FileNotFoundError when
    there is no such object, OSError when the store cannot be read."""
    with filesystem.open_input_file(path) as source:
        try:
            return pq.read_metadata(source)
        except (pa.ArrowInvalid, pa.ArrowIOError) as exc:
            if isinstance(exc, FileNotFoundError | PermissionError):
                raise
            raise DamagedFileError(name, _unreadable_footer(source, source.size(), exc)) from None


def verify_object(
    filesystem: pafs.FileSystem, path: str, name: str, size: int | None = None
) -> Verification:
    """:func:`verify_parquet` for the object ``path`` of ``filesystem`` (not the local disk:
    object storage); ``name`` (its URI) is how errors and the result name it. An object of
    up to :data:`WHOLE_OBJECT_BYTES` (``size``, when known from a listing) is read in one
    request and verified in memory; a larger one with ranged reads, a row group at a time."""
    with filesystem.open_input_file(path) as remote:
        whole = (size if size is not None else remote.size()) <= WHOLE_OBJECT_BYTES
        source = pa.BufferReader(remote.read_buffer()) if whole else remote
        try:
            parquet = pq.ParquetFile(source, page_checksum_verification=True)
        except (pa.ArrowInvalid, pa.ArrowIOError) as exc:
            if isinstance(exc, FileNotFoundError | PermissionError):
                raise
            raise DamagedFileError(name, _unreadable_footer(source, source.size(), exc)) from None
        with parquet:
            metadata = parquet.metadata
            try:
                checksummed = _first_page_has_crc(source, metadata)
                for index in range(metadata.num_row_groups):
                    parquet.read_row_group(index, use_threads=True)
            except (OSError, pa.ArrowException) as exc:
                if isinstance(exc, FileNotFoundError | PermissionError):
                    raise
                raise read_error_named(name, exc) from None
    return Verification(name, int(metadata.num_rows), checksummed)


def parquet_problem(path: Path) -> tuple[str | None, bool]:
    """What is wrong with ``path`` (None when it reads whole) and whether its pages carry
    checksums (False also for a damaged file)."""
    try:
        found = verify_parquet(path)
    except DamagedFileError as exc:
        return exc.problem, False
    except OSError as exc:
        return f"it cannot be read ({exc})", False
    return None, found.checksummed


_verified: OrderedDict[tuple[str, int, int, int], bool] = OrderedDict()
_verified_lock = threading.Lock()


def _key(path: Path) -> tuple[str, int, int, int]:
    stat = os.stat(path)
    return (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


def verify_files(paths: Iterable[Path]) -> list[Path]:
    """Verify each of ``paths`` (:func:`verify_parquet`) unless this process verified it
    before unchanged; returns those without page checksums (read, but unverifiable). Raises
    DamagedFileError for the first damaged one."""
    unverifiable = []
    for path in paths:
        key = _key(path)
        with _verified_lock:
            known = _verified.get(key)
            if known is not None:
                _verified.move_to_end(key)
        if known is None:
            known = verify_parquet(path).checksummed
            with _verified_lock:
                _verified[key] = known
                if len(_verified) > _VERIFIED_CACHE:
                    _verified.popitem(last=False)
        if not known:
            unverifiable.append(path)
    return unverifiable


def verify_objects(
    filesystem: pafs.FileSystem, objects: Iterable[tuple[pafs.FileInfo, str]]
) -> list[str]:
    """:func:`verify_files` for objects of ``filesystem`` (their listed ``FileInfo`` and
    URI): each verified unless this process verified it before with the same URI, size and
    modification time (ti publishes an object once and never rewrites it). Returns the URIs
    of those without page checksums; DamagedFileError naming the first damaged one."""
    unverifiable = []
    for info, uri in objects:
        mtime = info.mtime_ns if info.mtime_ns is not None else -1
        key = (uri, -1, info.size if info.size is not None else -1, mtime)
        with _verified_lock:
            known = _verified.get(key)
            if known is not None:
                _verified.move_to_end(key)
        if known is None:
            known = verify_object(filesystem, info.path, uri, info.size).checksummed
            with _verified_lock:
                _verified[key] = known
                if len(_verified) > _VERIFIED_CACHE:
                    _verified.popitem(last=False)
        if not known:
            unverifiable.append(uri)
    return unverifiable


__all__ = [
    "PAGE_CHECKSUMS",
    "DamagedFileError",
    "Verification",
    "has_page_checksums",
    "open_verified",
    "parquet_problem",
    "parquet_rows",
    "parquet_write_options",
    "read_error",
    "read_error_named",
    "read_footer",
    "verify_files",
    "verify_object",
    "verify_objects",
    "verify_parquet",
]
