"""``ti_io.write.parts.conform``: every stored row passes through it on its way into a part.

Batches that already carry the contract's fields are relabelled with the run's schema (its
``ti`` metadata) without copying; anything else is cast, which decodes dictionary strings and
refuses nulls in a non-nullable column.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from ti_io.write.parts import conform
from ti_schema import histogram_schema, history_schema
from ti_schema.testing import example_histogram_table, example_history_table

RUN_SCHEMA = history_schema("ti-core 0.2.0", window=20)
HISTOGRAMS = histogram_schema("ti-core 0.2.0", window=20)


def batches(dictionary: bool = False) -> list[pa.RecordBatch]:
    table = example_history_table(54, producer="ti-core 0.2.0", dictionary=dictionary)
    return table.to_batches(max_chunksize=20)


def test_batches_with_the_contract_fields_are_relabelled_without_a_copy() -> None:
    sent = batches()
    assert sent[0].schema.metadata != RUN_SCHEMA.metadata  # the run adds its window
    table = conform(sent, RUN_SCHEMA)
    assert table.schema.equals(RUN_SCHEMA, check_metadata=True)
    assert table.to_pylist() == [row for b in sent for row in b.to_pylist()]
    for i in range(table.num_columns):  # the same buffers, chunk by chunk
        for chunk, batch in zip(table.column(i).chunks, sent, strict=True):
            got = [b.address for b in chunk.buffers() if b is not None]
            assert got == [b.address for b in batch.column(i).buffers() if b is not None]


def test_dictionary_strings_are_decoded() -> None:
    sent = batches(dictionary=True)
    assert any(pa.types.is_dictionary(f.type) for f in sent[0].schema)
    table = conform([*sent, *batches()], RUN_SCHEMA)  # both kinds, in order
    assert table.schema.equals(RUN_SCHEMA, check_metadata=True)
    plain = [row for b in batches() for row in b.to_pylist()]
    assert table.to_pylist() == plain + plain


def test_nulls_in_a_non_nullable_column_are_refused() -> None:
    (batch, *_) = batches()
    i = batch.schema.get_field_index("layer")
    assert not batch.schema.field(i).nullable
    broken = batch.set_column(
        i, batch.schema.field(i), pa.array([None] * batch.num_rows, pa.string())
    )
    with pytest.raises(ValueError, match="layer"):
        conform([broken], RUN_SCHEMA)


def test_nulls_are_refused_where_the_nullable_columns_hold_none() -> None:
    table = example_histogram_table(producer="ti-core 0.2.0")
    table = table.filter(table["min"].is_valid())  # every nullable column without nulls
    i = table.schema.get_field_index("layer")
    nulls = pa.array([None] * table.num_rows, pa.string())
    broken = table.set_column(i, table.schema.field(i), nulls).combine_chunks().to_batches()
    with pytest.raises(ValueError, match="layer"):
        conform(broken, HISTOGRAMS)


def test_other_field_metadata_is_replaced_by_the_contracts() -> None:
    (batch, *_) = batches()
    bare = pa.schema([f.remove_metadata() for f in batch.schema], metadata=batch.schema.metadata)
    table = conform([pa.RecordBatch.from_arrays(batch.columns, schema=bare)], RUN_SCHEMA)
    assert table.schema.equals(RUN_SCHEMA, check_metadata=True)
    assert table.to_pylist() == batch.to_pylist()


def test_no_batches_give_an_empty_table_of_the_schema() -> None:
    table = conform([], RUN_SCHEMA)
    assert table.num_rows == 0
    assert table.schema.equals(RUN_SCHEMA, check_metadata=True)
