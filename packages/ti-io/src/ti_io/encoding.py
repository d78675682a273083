"""How the run directory's Parquet files store string columns: dictionary-encoded.

Parts and the final files are written from dictionary arrays, so the Parquet writer stores
their indices and dictionary pages without hashing every string again, and their footer records
the contract's own Arrow schema (``ARROW:schema``, strings), so every reader gets the exact
``ti_schema`` types, field docs and schema metadata back, as if strings had been written.
"""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc

_INDEX: Final[pa.DataType] = pa.int32()


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """Columns worth Parquet dictionary encoding: the strings (plain or already encoded).
    (Encoding floats, ids and timestamps too costs CPU and makes the file larger.)"""
    return [
        f.name
        for f in schema
        if pa.types.is_string(f.type)
        or (pa.types.is_dictionary(f.type) and pa.types.is_string(f.type.value_type))
    ]


def dictionary_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with its string columns dictionary-encoded (int32 indices)."""
    return pa.schema(
        [
            f.with_type(pa.dictionary(_INDEX, f.type)) if pa.types.is_string(f.type) else f
            for f in schema
        ],
        metadata=schema.metadata,
    )


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with its dictionary-encoded columns decoded (the contract's types)."""
    return pa.schema(
        [f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in schema],
        metadata=schema.metadata,
    )


def arrow_footer_metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    """The Parquet footer key-value metadata that pyarrow writes for a table of ``schema``:
    the schema's own metadata and the serialized Arrow schema (``ARROW:schema``, base64;
    Arrow's convention), from which readers restore the exact Arrow types and field metadata.
    (``ti_schema.footer_metadata`` is the schema metadata alone, as Polars' writer takes it.)"""
    metadata = dict(schema.metadata or {})
    metadata[b"ARROW:schema"] = base64.b64encode(schema.serialize().to_pybytes())
    return metadata


class DictionaryCache:
    """Dictionary-encoded copies of the string arrays seen recently, found again by their
    buffers.

    ti-core builds a run's identity columns (layer, module type, path, mode, dtype, signal,
    metric, run id) once per repeating entry structure and hands the same arrays over sample
    after sample, so the part writer encodes each of them once instead of hashing every row's
    string for every part. A cached entry keeps its source array alive, so the buffer addresses
    that key it cannot be reused by another array while it is cached. Thread-safe.
    """

    def __init__(self, size: int = 128) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, ...], tuple[pa.Array, pa.DictionaryArray]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, array: pa.Array) -> pa.DictionaryArray:
        """``array`` (strings) dictionary-encoded with int32 indices; nulls stay nulls."""
        key = (
            array.offset,
            len(array),
            *(0 if b is None else b.address for b in array.buffers()),
        )
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[1]
        encoded = pc.dictionary_encode(array)
        if encoded.type.index_type != _INDEX:  # pragma: no cover - int32 is the default
            encoded = encoded.cast(pa.dictionary(_INDEX, encoded.type.value_type))
        if array.null_count == len(array):  # no reason given: built anew for every batch
            return encoded
        with self._lock:
            self._entries[key] = (array, encoded)
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return encoded


__all__ = [
    "DictionaryCache",
    "arrow_footer_metadata",
    "dictionary_columns",
    "dictionary_schema",
    "plain_schema",
]
