"""Damage done to real Parquet files of a run, as a disk, a copy or a person would do it.

Used by tests/test_reliability_integrity.py and by the ``skip_damaged`` scenario of
tests/finalization_faults.py. Each function changes one file in place and returns what it did.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pyarrow.parquet as pq


def value_page(path: Path) -> tuple[int, int]:
    """``(offset, size)`` of the ``value`` column chunk of the first row group: where its
    data pages lie (Parquet metadata: ``data_page_offset``, ``total_compressed_size``)."""
    metadata = pq.read_metadata(path)
    group = metadata.row_group(0)
    for index in range(group.num_columns):
        column = group.column(index)
        if column.path_in_schema == "value":
            assert not column.has_dictionary_page  # plain doubles: the chunk is data pages
            return column.data_page_offset, column.total_compressed_size
    raise AssertionError(f"{path} has no value column")


def flip_value_bit(path: Path, bit: int = 6) -> int:
    """Flip one bit of the last bytes of the ``value`` column's data page: compressed blocks
    end with literal bytes (LZ4 always, zstd's raw blocks too), so the page still decodes,
    into different numbers, unless its checksum is verified. Returns the byte offset."""
    offset, size = value_page(path)
    at = offset + size - 2
    data = bytearray(path.read_bytes())
    data[at] ^= 1 << bit
    path.write_bytes(bytes(data))
    return at


def truncate(path: Path, keep: int) -> int:
    """Cut ``path`` to its first ``keep`` bytes (a copy cut short); returns the old size."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return len(data)


def footer_start(path: Path) -> int:
    """Where the Thrift footer of ``path`` begins (its length is in the 4 bytes before the
    closing ``PAR1``)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[-8:-4])
    return len(data) - 8 - length


def remove_footer(path: Path) -> None:
    """Cut ``path`` just before its footer: every page is there, the metadata is not."""
    truncate(path, footer_start(path))


def garble_footer(path: Path) -> None:
    """Overwrite the first bytes of the footer, keeping its length and ``PAR1`` marker: the
    footer is there but does not parse."""
    start = footer_start(path)
    data = bytearray(path.read_bytes())
    data[start : start + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))


def zero(path: Path) -> None:
    """Replace every byte of ``path`` by zero (a block device that lost the file's content)."""
    path.write_bytes(b"\0" * path.stat().st_size)
