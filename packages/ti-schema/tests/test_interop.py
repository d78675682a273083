"""Helpers for engines that write Parquet without pyarrow's schema handling (Polars)."""

from __future__ import annotations

import pyarrow as pa

import ti_schema
from ti_schema import footer_metadata, large_types, polars_write_options, validate_history
from ti_schema.testing import example_history_table


def test_large_types_keep_the_contract() -> None:
    schema = ti_schema.history_schema("p 1")
    wide = large_types(schema)
    assert wide.names == schema.names
    assert wide.metadata == schema.metadata
    assert wide.field("layer").type == pa.large_string()
    assert wide.field("shape").type == pa.large_list(pa.int64())
    assert [f.nullable for f in wide] == [f.nullable for f in schema]
    assert wide.field("layer").metadata == schema.field("layer").metadata
    validate_history(wide)
    table = example_history_table()
    validate_history(table.cast(large_types(table.schema)))


def test_polars_write_options_carry_schema_and_footer_metadata() -> None:
    schema = ti_schema.histogram_schema("acme 0.1")
    options = polars_write_options(schema)
    assert set(options) == {"arrow_schema", "metadata"}
    assert options["metadata"] == footer_metadata(schema)
    assert ti_schema.parse_metadata(options["metadata"])["producer"] == "acme 0.1"
    ti_schema.validate_histograms(options["arrow_schema"])
