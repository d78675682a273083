"""Dense integer ids for the measurements of a history, assigned as its row groups stream by.

A measurement is a tuple of key columns (``GROUP_KEYS``: layer, call, signal, tensor path,
mode, grad_enabled, metric). Aggregating a long history by seven string and integer columns
would hash every row's strings; instead each row group's key columns are read as dictionary
indices and integers (:mod:`ti_io.read.row_groups`), combined into one integer per row, and
looked up in a table that maps those combined codes to the catalog's ids. The table is built
for a set of dictionaries and reused while the next row groups carry the same ones (a file's
row groups, and the parts of one run, usually do), so the strings of a measurement are decoded
once, when it is first seen, not once per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from ti_io.read.ordering import GROUP_KEYS

DENSE_TABLE_CODES: Final[int] = 1 << 22
"""Up to this many combined codes the lookup is a dense array (16 MiB at most); beyond it the
distinct codes of each row group are looked up in a dictionary."""

_CODINGS: Final[int] = 4
"""Lookups kept for the most recent sets of dictionaries (parts may alternate between a few)."""

Ids = npt.NDArray[np.uint32]

_DTYPES: Final[dict[str, pl.DataType]] = {
    "layer": pl.String(),
    "call_index": pl.Int32(),
    "signal": pl.String(),
    "tensor_path": pl.String(),
    "mode": pl.String(),
    "grad_enabled": pl.Boolean(),
    "metric": pl.String(),
}


@dataclass
class _Column:
    """One key column of a row group as integer codes: code ``c`` names ``values[c]`` (a
    dictionary's index, or an integer minus ``low``); a null is one more value (None).
    The codes themselves are made only when asked for (a column holding one value needs none).
    """

    source: pa.Array
    """Dictionary indices, or integers (booleans as int8)."""
    values: list[Any]
    dictionary: pa.Array | None
    """The dictionary the codes index (None for integer and boolean columns)."""
    low: int = 0

    @property
    def radix(self) -> int:
        return len(self.values)

    def codes(self) -> npt.NDArray[np.integer[Any]]:
        source = self.source
        if source.null_count:
            source = pc.fill_null(source, len(self.values) - 1 + self.low)
        codes: npt.NDArray[np.integer[Any]] = source.to_numpy(zero_copy_only=False)
        return codes - self.low if self.low else codes


def _column(column: pa.ChunkedArray) -> _Column:
    """``column`` as codes (see :class:`_Column`)."""
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        column = pc.dictionary_encode(column)
        kind = column.type
    if pa.types.is_dictionary(kind):
        if column.num_chunks > 1:
            column = column.unify_dictionaries()
        array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        if column.num_chunks == 0:
            array = pa.array([], kind)
        dictionary = array.dictionary
        values = dictionary.to_pylist()
        if array.indices.null_count:
            values.append(None)
        return _Column(array.indices, values, dictionary)
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_boolean(kind):
        values = [False, True, None] if array.null_count else [False, True]
        return _Column(pc.cast(array, pa.int8()), values, None)
    if pa.types.is_integer(kind):
        low, high = pc.min_max(array).values()
        if low.as_py() is None:  # every value null (or no row)
            return _Column(pa.nulls(len(array), pa.int64()), [None], None)
        low_value, high_value = int(low.as_py()), int(high.as_py())
        numbers: list[Any] = list(range(low_value, high_value + 1))
        if array.null_count:
            numbers.append(None)
        return _Column(array, numbers, None, low_value)
    raise TypeError(f"a key column must hold strings, integers or booleans, got {kind}")


@dataclass
class _Coding:
    """A lookup from a row group's combined codes to catalog ids, valid for row groups whose
    key columns have the same dictionaries and integer ranges."""

    columns: list[_Column]
    strides: list[int]
    size: int
    dense: npt.NDArray[np.int32] | None
    sparse: dict[int, int]

    def matches(self, columns: list[_Column]) -> bool:
        """Whether ``columns`` can be coded with this lookup: the same dictionaries, and
        integers within this lookup's ranges (their codes are then shifted to its own)."""
        for mine, theirs in zip(self.columns, columns, strict=True):
            if mine.dictionary is not None:
                if theirs.dictionary is None or not mine.dictionary.equals(theirs.dictionary):
                    return False
                if theirs.radix != mine.radix:  # a null slot came or went
                    return False
            elif theirs.dictionary is not None or (
                mine.values != theirs.values and not _within(theirs, mine)
            ):
                return False
        return True

    def combined(self, columns: list[_Column], rows: int) -> npt.NDArray[np.int64]:
        """One code per row for ``columns`` (which :meth:`matches` this lookup); int32
        arithmetic where the codes fit (half the memory traffic), returned as int64."""
        dtype = np.int32 if self.size < 1 << 31 else np.int64
        combined: npt.NDArray[Any] = np.zeros(rows, dtype=dtype)
        for mine, theirs, stride in zip(self.columns, columns, self.strides, strict=True):
            if not stride:
                continue
            codes = theirs.codes()
            if mine.dictionary is None and mine.values != theirs.values:
                codes = _recoded(theirs, mine, codes)
            if stride == 1:
                combined += codes
            else:
                combined += codes.astype(dtype, copy=False) * stride
        return combined.astype(np.int64, copy=False)


def _within(column: _Column, coding: _Column) -> bool:
    """Whether the integer (or boolean) ``column`` holds only values ``coding`` codes."""
    null = column.values and column.values[-1] is None
    if null and not (coding.values and coding.values[-1] is None):
        return False
    ints = column.values[:-1] if null else column.values
    known = coding.values[:-1] if coding.values and coding.values[-1] is None else coding.values
    return not ints or (bool(known) and known[0] <= ints[0] and ints[-1] <= known[-1])


def _recoded(
    column: _Column, coding: _Column, codes: npt.NDArray[np.integer[Any]]
) -> npt.NDArray[np.int64]:
    """``column``'s ``codes`` as ``coding`` numbers the same values (see :func:`_within`)."""
    wide = codes.astype(np.int64)
    shifted: npt.NDArray[np.int64] = wide + (column.low - coding.low)
    if column.values[-1] is None:
        shifted = np.where(wide == len(column.values) - 1, len(coding.values) - 1, shifted)
    return shifted


class KeyCatalog:
    """The measurements seen so far, each with a dense id (0, 1, ... in order of first
    appearance), and the ids of each row group's rows (:meth:`ids`).

    ``keep`` (optional) decides once per measurement, from its key tuple, whether readers keep
    its rows (:attr:`kept`, indexed by id): how ``--layer`` / ``--metric`` filters apply
    without a per-row string comparison.
    """

    def __init__(
        self,
        names: Sequence[str] = GROUP_KEYS,
        keep: Callable[[tuple[Any, ...]], bool] | None = None,
    ) -> None:
        self.names: tuple[str, ...] = tuple(names)
        self._ids: dict[tuple[Any, ...], int] = {}
        self._keys: list[tuple[Any, ...]] = []
        self._keep = keep
        self._kept: list[bool] = []
        self._codings: list[_Coding] = []

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def kept(self) -> npt.NDArray[np.bool_]:
        """Per id: whether its rows are kept (every one without ``keep``)."""
        return np.array(self._kept, dtype=bool)

    def key(self, id_: int) -> tuple[Any, ...]:
        return self._keys[id_]

    def ids(self, table: pa.Table) -> Ids:
        """The id of each row of ``table`` (which has every key column); measurements not
        seen before get new ids."""
        columns = [_column(table.column(name)) for name in self.names]
        coding = next((c for c in self._codings if c.matches(columns)), None)
        if coding is None:
            coding = self._new_coding(columns)
            self._codings = [coding, *self._codings[: _CODINGS - 1]]
        combined = coding.combined(columns, table.num_rows)
        if coding.dense is not None:
            found = coding.dense[combined]
            missing = found < 0
            if missing.any():
                for code in np.unique(combined[missing]).tolist():
                    coding.dense[code] = self._id_of(coding, code)
                found = coding.dense[combined]
            ids: Ids = found.astype(np.uint32)
            return ids
        encoded = pc.dictionary_encode(pa.array(combined))
        distinct = encoded.dictionary.to_numpy()
        lookup = np.empty(len(distinct), dtype=np.uint32)
        for at, code in enumerate(distinct.tolist()):
            known = coding.sparse.get(code)
            if known is None:
                known = coding.sparse[code] = self._id_of(coding, code)
            lookup[at] = known
        ids = lookup[encoded.indices.to_numpy()]
        return ids

    def _new_coding(self, columns: list[_Column]) -> _Coding:
        strides = []
        size = 1
        for column in columns:
            strides.append(size if column.radix > 1 else 0)
            size *= max(column.radix, 1)
        if size >= 1 << 62:
            raise ValueError(
                f"the key columns {list(self.names)} hold too many distinct values to combine "
                f"({size} combinations in one row group)"
            )
        dense = np.full(size, -1, dtype=np.int32) if size <= DENSE_TABLE_CODES else None
        return _Coding(columns, strides, size, dense, {})

    def _id_of(self, coding: _Coding, code: int) -> int:
        key = tuple(
            column.values[(code // stride) % column.radix if stride else 0]
            for column, stride in zip(coding.columns, coding.strides, strict=True)
        )
        known = self._ids.get(key)
        if known is None:
            known = self._ids[key] = len(self._keys)
            self._keys.append(key)
            self._kept.append(True if self._keep is None else bool(self._keep(key)))
        return known

    def frame(self) -> pl.DataFrame:
        """One row per measurement: ``key`` (its id, UInt32) and the key columns."""
        columns = {
            name: pl.Series(name, [k[i] for k in self._keys], dtype=_DTYPES.get(name))
            for i, name in enumerate(self.names)
        }
        ids = pl.Series("key", range(len(self._keys)), dtype=pl.UInt32)
        return pl.DataFrame([ids, *columns.values()])


__all__ = ["DENSE_TABLE_CODES", "KeyCatalog"]
