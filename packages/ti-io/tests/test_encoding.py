"""Dictionary-encoded string columns in parts (``ti_io.encoding``, ``ti_io.write.parts``).

Parts are written from dictionary arrays and must read back exactly as the contract's strings
(types, field docs, schema metadata, values, nulls). The cache that encodes each repeated
identity column once must never hand back another array's encoding.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from ti_io.encoding import (
    DictionaryCache,
    dictionary_columns,
    dictionary_schema,
    plain_schema,
)
from ti_io.write.parts import conform, part_table, write_parquet
from ti_schema import histogram_schema, history_schema
from ti_schema.testing import example_histogram_table, example_history_table

RUN_SCHEMA = history_schema("ti-core 0.2.0", window=20)
HISTOGRAMS = histogram_schema("ti-core 0.2.0", window=20)


def _batches(rows: int = 54) -> list[pa.RecordBatch]:
    return example_history_table(rows, producer="ti-core 0.2.0").to_batches(max_chunksize=20)


def test_a_repeated_array_is_encoded_once_and_equal_content_elsewhere_again() -> None:
    cache = DictionaryCache()
    strings = pa.array(["a", "b", None, "a"], pa.string())
    first = cache.encode(strings)
    assert first.type == pa.dictionary(pa.int32(), pa.string())
    assert first.to_pylist() == ["a", "b", None, "a"]
    assert cache.encode(strings) is first  # the same buffers: found again
    twin = pa.array(["a", "b", None, "a"], pa.string())  # equal values, other buffers
    again = cache.encode(twin)
    assert again is not first
    assert again.to_pylist() == first.to_pylist()
    assert len(cache) == 2


def test_slices_of_one_array_are_told_apart() -> None:
    cache = DictionaryCache()
    strings = pa.array([f"s{i}" for i in range(10)], pa.string())
    head, tail, mid = strings.slice(0, 5), strings.slice(5, 5), strings.slice(2, 5)
    for part in (head, tail, mid, head, tail, mid):
        assert cache.encode(part).to_pylist() == part.to_pylist()
    assert len(cache) == 3


def test_all_null_columns_are_not_kept_and_the_oldest_entry_goes_first() -> None:
    cache = DictionaryCache(size=2)
    nulls = pa.nulls(4, pa.string())
    assert cache.encode(nulls).to_pylist() == [None] * 4
    assert len(cache) == 0
    a, b, c = (pa.array([x], pa.string()) for x in "abc")
    first = cache.encode(a)
    cache.encode(b)
    assert cache.encode(a) is first  # a is now the most recent
    cache.encode(c)  # evicts b, the least recently used
    assert len(cache) == 2
    assert cache.encode(a) is first
    assert cache.encode(b) is not None
    # a source array stays alive while cached: its buffers cannot be reused by another
    assert all(entry[0] is not None for entry in cache._entries.values())


def test_schemas_round_trip_with_their_metadata() -> None:
    encoded = dictionary_schema(RUN_SCHEMA)
    assert dictionary_columns(encoded) == dictionary_columns(RUN_SCHEMA)
    assert all(
        pa.types.is_dictionary(encoded.field(name).type) for name in dictionary_columns(RUN_SCHEMA)
    )
    assert plain_schema(encoded).equals(RUN_SCHEMA, check_metadata=True)
    assert encoded.field("layer").metadata == RUN_SCHEMA.field("layer").metadata


def test_part_tables_hold_the_conformed_rows_with_one_dictionary_per_column() -> None:
    cache = DictionaryCache()
    sent = _batches()
    table = part_table(sent, RUN_SCHEMA, cache)
    assert table.schema.equals(dictionary_schema(RUN_SCHEMA), check_metadata=True)
    assert table.to_pylist() == conform(sent, RUN_SCHEMA).to_pylist()
    for name in dictionary_columns(RUN_SCHEMA):
        chunks = table.column(name).chunks
        assert all(chunk.dictionary.equals(chunks[0].dictionary) for chunk in chunks)
    again = part_table(sent, RUN_SCHEMA, cache)  # the same arrays: served from the cache
    assert again.to_pylist() == table.to_pylist()
    assert part_table([], RUN_SCHEMA, cache).num_rows == 0


def test_parts_read_back_as_the_contract(tmp_path: Path) -> None:
    cache = DictionaryCache()
    for schema, sent in (
        (RUN_SCHEMA, _batches()),
        (HISTOGRAMS, example_histogram_table(producer="ti-core 0.2.0").to_batches()),
    ):
        path = tmp_path / f"{len(schema)}.parquet"
        write_parquet(path, part_table(sent, schema, cache))
        plain = tmp_path / f"{len(schema)}-plain.parquet"  # as parts were written before
        pq.write_table(conform(sent, schema), plain)
        back, before = pq.read_table(path), pq.read_table(plain)
        assert back.schema.equals(before.schema, check_metadata=True)  # docs, ti metadata
        assert back.schema.metadata == schema.metadata
        assert back.field("layer").type == pa.string()
        assert back.to_pylist() == before.to_pylist() == conform(sent, schema).to_pylist()
        frame = pl.read_parquet(path)
        assert frame.schema["layer"] == pl.String
        assert frame.height == sum(b.num_rows for b in sent)
