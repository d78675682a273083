"""validate_histograms: the ti.histograms contract and its data rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ti_schema
from ti_schema import IDENTITY_COLUMNS, SchemaMismatchError, validate_histograms
from ti_schema.testing import example_histogram_table


def replace(table: pa.Table, name: str, values: list[Any]) -> pa.Table:
    index = table.column_names.index(name)
    field = table.schema.field(index)
    return table.set_column(index, field, pa.array(values, field.type))


def problems(table: pa.Table) -> str:
    with pytest.raises(SchemaMismatchError) as info:
        validate_histograms(table)
    assert info.value.subject == "ti.histograms"
    return str(info.value)


def test_histogram_schema_shares_the_identity_columns() -> None:
    schema = ti_schema.histogram_schema()
    assert tuple(schema.names[: len(IDENTITY_COLUMNS)]) == IDENTITY_COLUMNS
    assert ti_schema.parse_metadata(schema)["schema"] == "ti.histograms"
    validate_histograms(schema)


@pytest.mark.parametrize("dictionary", [False, True])
def test_example_tables_validate_and_survive_parquet(dictionary: bool, tmp_path: Path) -> None:
    table = example_histogram_table(dictionary=dictionary)
    validate_histograms(table)
    pq.write_table(table, tmp_path / "histograms.parquet")
    read = pq.read_table(tmp_path / "histograms.parquet")
    validate_histograms(read)
    assert read.schema.metadata == table.schema.metadata


def test_history_table_is_not_a_histogram_table() -> None:
    from ti_schema.testing import example_history_table

    text = problems(example_history_table())
    assert "describes schema 'ti.history', not 'ti.histograms'" in text
    assert "column 'bucket_limits': is missing" in text
    assert "column 'metric': is not part of ti.histograms 1.5" in text


def test_bucket_lists_must_have_equal_lengths() -> None:
    table = example_histogram_table()
    limits = table.column("bucket_limits").to_pylist()
    limits[2] = [0.0, 1.0]
    assert "1 row(s), first at row 2, have lists of different lengths" in problems(
        replace(table, "bucket_limits", limits)
    )


def test_bucket_counts_must_sum_to_num() -> None:
    table = example_histogram_table()
    nums = table.column("num").to_pylist()
    nums[4] += 1
    assert "first at row 4, have bucket counts that do not sum to num" in problems(
        replace(table, "num", nums)
    )


def test_min_and_max_are_null_exactly_when_there_are_no_finite_entries() -> None:
    table = example_histogram_table(rows=2)
    empty = replace(table, "bucket_counts", [[0, 0, 0], [1, 2, 1]])
    empty = replace(empty, "num", [0, 4])
    text = problems(empty)
    assert "'min': 1 row(s), first at row 0, break the rule that min is null exactly" in text
    assert "'max': 1 row(s)" in text
    validate_histograms(replace(replace(empty, "min", [None, -1.5]), "max", [None, 1.0]))
    assert "'min': 1 row(s), first at row 1" in problems(replace(table, "min", [-1.5, None]))


def test_signal_domain_and_retype_are_reported_together() -> None:
    table = example_histogram_table()
    table = replace(table, "signal", ["weight"] * table.num_rows)
    index = table.column_names.index("nonfinite_count")
    field = table.schema.field(index).with_type(pa.int32())
    table = table.set_column(index, field, table.column(index).cast(pa.int32()))
    text = problems(table)
    assert "column 'signal': holds ['weight']" in text
    assert "column 'nonfinite_count': has type int32; the contract says int64" in text
