"""validate_history: every kind of mismatch, accepted encodings, data rules, Parquet round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ti_schema
from ti_schema import SchemaMismatchError, validate_history
from ti_schema.testing import example_history_table


def replace_column(
    table: pa.Table, name: str, field: pa.Field, array: Any | None = None
) -> pa.Table:
    """``table`` with column ``name`` replaced by ``field`` (data cast unless given)."""
    index = table.column_names.index(name)
    data = table.column(index).cast(field.type) if array is None else array
    return table.set_column(index, field, data)


def errors_of(source: Any, **kwargs: Any) -> SchemaMismatchError:
    with pytest.raises(SchemaMismatchError) as info:
        validate_history(source, **kwargs)
    return info.value


def with_ti(table: pa.Table, **changes: Any) -> pa.Table:
    doc = ti_schema.parse_metadata(table)
    doc.update(changes)
    return table.replace_schema_metadata({b"ti": json.dumps(doc).encode()})


@pytest.fixture
def table() -> pa.Table:
    return example_history_table()


def test_contract_tables_schemas_and_batches_validate(table: pa.Table) -> None:
    validate_history(table)
    validate_history(table.schema)
    validate_history(table.to_batches()[0])
    validate_history(ti_schema.history_schema())
    validate_history(ti_schema.history_schema("my-producer 2.0"))
    validate_history(table.slice(0, 0))


def test_error_is_a_value_error_listing_every_problem(table: pa.Table) -> None:
    broken = table.drop_columns(["rank", "dtype"]).append_column("extra", pa.array([1] * 54))
    error = errors_of(broken.replace_schema_metadata(None))
    assert isinstance(error, ValueError)
    assert error.subject == "ti.history"
    wheres = {m.where for m in error.mismatches}
    assert {"column 'rank'", "column 'dtype'", "column 'extra'", "schema metadata"} <= wheres
    assert error.kinds == {"missing_column", "extra_column", "missing_metadata"}
    text = str(error)
    assert "4 problems" in text
    for mismatch in error.mismatches:
        assert str(mismatch) in text


def test_missing_column_names_it_and_its_expected_type(table: pa.Table) -> None:
    error = errors_of(table.drop_columns(["timestamp"]))
    assert [m.kind for m in error.mismatches] == ["missing_column"]
    assert "column 'timestamp': is missing (expected timestamp[us, tz=UTC] not null)" in str(error)


def test_extra_column_is_refused_at_the_same_minor(table: pa.Table) -> None:
    error = errors_of(table.append_column("loss", pa.array([0.5] * table.num_rows)))
    assert [m.kind for m in error.mismatches] == ["extra_column"]
    assert "column 'loss': is not part of ti.history 1.5" in str(error)


def test_duplicate_column_is_reported(table: pa.Table) -> None:
    duplicated = table.append_column(table.schema.field("layer"), table.column("layer"))
    assert errors_of(duplicated).kinds == {"duplicate_column"}


@pytest.mark.parametrize(
    ("column", "wrong"),
    [
        ("rank", pa.int64()),
        ("sample_id", pa.int32()),
        ("timestamp", pa.timestamp("ns", tz="UTC")),
        ("timestamp", pa.timestamp("us")),
        ("value", pa.float32()),
        ("grad_enabled", pa.int8()),
        ("shape", pa.list_(pa.int32())),
        ("layer", pa.binary()),
    ],
)
def test_retyped_column_names_both_types(table: pa.Table, column: str, wrong: pa.DataType) -> None:
    field = table.schema.field(column).with_type(wrong)
    error = errors_of(replace_column(table, column, field))
    assert [m.kind for m in error.mismatches] == ["type"]
    expected = table.schema.field(column).type
    assert f"column '{column}': has type {wrong}; the contract says {expected}" in str(error)


def test_not_null_column_declared_nullable_is_refused(table: pa.Table) -> None:
    field = table.schema.field("layer").with_nullable(True)
    error = errors_of(replace_column(table, "layer", field))
    assert [m.kind for m in error.mismatches] == ["nullability"]
    assert "column 'layer': is declared nullable; the contract says not null" in str(error)


def test_nullable_column_declared_not_null_is_refused(table: pa.Table) -> None:
    available = table.filter(table.column("value").is_valid())
    field = available.schema.field("value").with_nullable(False)
    error = errors_of(replace_column(available, "value", field))
    assert [m.kind for m in error.mismatches] == ["nullability"]
    assert "column 'value': is declared not null" in str(error)


def test_nullability_data_mode_accepts_undeclared_flags_when_the_data_holds_no_nulls(
    table: pa.Table,
) -> None:
    relaxed = pa.schema([f.with_nullable(True) for f in table.schema], table.schema.metadata)
    loose = table.cast(relaxed)
    assert errors_of(loose).kinds == {"nullability"}
    validate_history(loose, nullability="data")
    # a schema alone cannot show its data has no nulls
    assert errors_of(loose.schema, nullability="data").kinds == {"nullability"}
    holes = replace_column(
        loose, "layer", loose.schema.field("layer"), pa.array([None] * loose.num_rows, pa.string())
    )
    error = errors_of(holes, nullability="data")
    assert "column 'layer': holds 54 null(s); the contract says not null" in str(error)
    with pytest.raises(ValueError, match="nullability must be 'schema' or 'data'"):
        validate_history(table, nullability="lenient")  # type: ignore[arg-type]


def test_missing_metadata(table: pa.Table) -> None:
    error = errors_of(table.replace_schema_metadata(None))
    assert [m.kind for m in error.mismatches] == ["missing_metadata"]
    assert "no 'ti' key" in str(error)
    error = errors_of(table.replace_schema_metadata({b"other": b"x"}))
    assert error.kinds == {"missing_metadata"}


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "is not valid JSON"),
        (b'["ti.history", "1.0"]', "must be a JSON object"),
        (b'{"schema": "ti.history", "schema_version": "1.0"}', "non-empty string 'producer'"),
        (b'{"schema_version": "1.0", "producer": "p"}', "non-empty string 'schema'"),
        (b'{"schema": "other.table", "schema_version": "1.0", "producer": "p"}', "'other.table'"),
    ],
)
def test_foreign_metadata(table: pa.Table, raw: bytes, needle: str) -> None:
    error = errors_of(table.replace_schema_metadata({b"ti": raw}))
    assert error.kinds == {"foreign_metadata"}
    assert needle in str(error)


def test_histogram_metadata_on_a_history_table_is_foreign(table: pa.Table) -> None:
    error = errors_of(with_ti(table, schema="ti.histograms"))
    assert error.kinds == {"foreign_metadata"}
    assert "describes schema 'ti.histograms', not 'ti.history'" in str(error)
    assert "use the matching validate_* function" in str(error)


@pytest.mark.parametrize("version", ["1", "v1.0", "1.0.0", "one", ""])
def test_unparsable_version_is_unsupported(table: pa.Table, version: str) -> None:
    error = errors_of(with_ti(table, schema_version=version))
    kind = "foreign_metadata" if version == "" else "unsupported_version"
    assert kind in error.kinds


def test_field_doc_metadata_is_not_required(table: pa.Table) -> None:
    bare = pa.schema([f.remove_metadata() for f in table.schema], table.schema.metadata)
    validate_history(table.cast(bare))


def test_column_order_does_not_matter(table: pa.Table) -> None:
    validate_history(table.select(list(reversed(table.column_names))))


STRING_TYPES = [
    pa.large_string(),
    pa.dictionary(pa.int8(), pa.string()),
    pa.dictionary(pa.int32(), pa.string()),
    pa.dictionary(pa.uint16(), pa.large_string()),
    pa.dictionary(pa.int64(), pa.string()),
]
if hasattr(pa, "string_view"):  # pyarrow >= 16; Polars exports string_view
    STRING_TYPES.append(pa.string_view())


@pytest.mark.parametrize("string_type", STRING_TYPES, ids=str)
def test_every_string_encoding_is_accepted_for_every_string_column(
    table: pa.Table, string_type: pa.DataType
) -> None:
    for field in table.schema:
        if field.type == pa.string():
            table = replace_column(table, field.name, field.with_type(string_type))
    validate_history(table)


def test_dictionary_of_non_strings_is_a_retype(table: pa.Table) -> None:
    field = table.schema.field("layer").with_type(pa.dictionary(pa.int32(), pa.binary()))
    assert errors_of(replace_column(table, "layer", field)).kinds == {"type"}
    ranks = table.column("rank").dictionary_encode()
    field = table.schema.field("rank").with_type(ranks.type)
    assert errors_of(replace_column(table, "rank", field, ranks)).kinds == {"type"}


def test_large_lists_and_utc_spellings_are_accepted(table: pa.Table) -> None:
    shape = table.schema.field("shape")
    validate_history(replace_column(table, "shape", shape.with_type(pa.large_list(pa.int64()))))
    named = pa.list_(pa.field("element", pa.int64()))
    validate_history(replace_column(table, "shape", shape.with_type(named)))
    stamp = table.schema.field("timestamp")
    for zone in ("Etc/UTC", "+00:00"):
        validate_history(
            replace_column(table, "timestamp", stamp.with_type(pa.timestamp("us", tz=zone)))
        )
    wrong_zone = stamp.with_type(pa.timestamp("us", tz="Europe/Paris"))
    assert errors_of(replace_column(table, "timestamp", wrong_zone)).kinds == {"type"}


def test_example_table_with_dictionary_encoding_is_valid() -> None:
    table = example_history_table(dictionary=True)
    assert pa.types.is_dictionary(table.schema.field("metric").type)
    validate_history(table)


def test_value_must_be_null_exactly_when_a_reason_is_given(table: pa.Table) -> None:
    value = table.column("value").to_pylist()
    reason = table.column("unavailable_reason").to_pylist()
    first_available = next(i for i, r in enumerate(reason) if r is None)
    first_unavailable = next(i for i, r in enumerate(reason) if r is not None)
    reason[first_available] = "both set"
    value[first_unavailable] = 1.0
    broken = replace_column(
        table, "value", table.schema.field("value"), pa.array(value, pa.float64())
    )
    broken = replace_column(
        broken,
        "unavailable_reason",
        table.schema.field("unavailable_reason"),
        pa.array(reason, pa.string()),
    )
    error = errors_of(broken)
    assert error.kinds == {"data"}
    first = min(first_available, first_unavailable)
    assert f"2 row(s), first at row {first}" in str(error)
    assert "value is null exactly when unavailable_reason is not null" in str(error)


def test_a_null_value_without_a_reason_is_refused(table: pa.Table) -> None:
    value = table.column("value").to_pylist()
    value[0] = None
    broken = replace_column(
        table, "value", table.schema.field("value"), pa.array(value, pa.float64())
    )
    assert "first at row 0" in str(errors_of(broken))


@pytest.mark.parametrize(("column", "bad"), [("signal", "activations"), ("mode", "inference")])
def test_signal_and_mode_domains(table: pa.Table, column: str, bad: str) -> None:
    values = table.column(column).to_pylist()
    values[3] = bad
    field = table.schema.field(column)
    broken = replace_column(table, column, field, pa.array(values, pa.string()))
    error = errors_of(broken)
    assert error.kinds == {"data"}
    assert f"column '{column}': holds ['{bad}']" in str(error)
    encoded = replace_column(
        broken, column, field.with_type(pa.dictionary(pa.int32(), pa.string()))
    )
    assert f"holds ['{bad}']" in str(errors_of(encoded))


def test_negative_counters_are_refused(table: pa.Table) -> None:
    ranks = pa.array([-1] * table.num_rows, pa.int32())
    error = errors_of(replace_column(table, "rank", table.schema.field("rank"), ranks))
    assert "column 'rank': 54 negative value(s), first at row 0" in str(error)


def test_nulls_in_a_not_null_column_are_refused_even_when_declared_not_null(
    table: pa.Table,
) -> None:
    metrics = table.column("metric").to_pylist()
    metrics[5] = None
    broken = replace_column(
        table, "metric", table.schema.field("metric"), pa.array(metrics, pa.string())
    )
    assert "column 'metric': holds 1 null(s)" in str(errors_of(broken))


def test_non_arrow_input_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"validate_history\(table_or_schema\) takes a pyarrow"):
        validate_history({"run_id": ["a"]})


def test_arrow_c_stream_exporters_are_accepted(table: pa.Table) -> None:
    class Exporter:
        def __arrow_c_stream__(self, requested_schema: object = None) -> object:
            return table.__arrow_c_stream__(requested_schema)

    validate_history(Exporter())


def test_parquet_round_trip_keeps_the_contract(table: pa.Table, tmp_path: Path) -> None:
    path = tmp_path / "history.parquet"
    pq.write_table(table, path)
    read = pq.read_table(path)
    assert read.schema.metadata[b"ti"] == table.schema.metadata[b"ti"]
    assert read.schema.field("run_id").metadata == table.schema.field("run_id").metadata
    assert not read.schema.field("run_id").nullable
    validate_history(read)
    validate_history(pq.read_schema(path))
    assert read.equals(table)
    ti_schema.check_compatible(pq.read_metadata(path).metadata)


def test_parquet_round_trip_of_dictionary_columns(tmp_path: Path) -> None:
    path = tmp_path / "history.parquet"
    written = example_history_table(dictionary=True)
    assert written.num_rows > 0
    pq.write_table(written, path)
    for read in (pq.read_table(path), pq.read_table(path, read_dictionary=["layer", "metric"])):
        validate_history(read)
        assert read.to_pylist() == written.to_pylist()  # values, not only the schema


def test_metadata_argument_replaces_a_lost_one(table: pa.Table, tmp_path: Path) -> None:
    path = tmp_path / "history.parquet"
    pq.write_table(table, path)
    stripped = table.replace_schema_metadata(None)
    assert errors_of(stripped).kinds == {"missing_metadata"}
    validate_history(stripped, metadata=pq.read_metadata(path).metadata)
    as_text = {"ti": table.schema.metadata[b"ti"].decode()}
    validate_history(stripped, metadata=as_text)


def test_domains_are_checked_across_chunks_with_different_dictionaries() -> None:
    good = example_history_table(18, dictionary=True)
    modes = ["eval"] * 9 + ["predict"] * 9
    field = good.schema.field("mode")
    bad = good.set_column(
        good.column_names.index("mode"), field, pa.array(modes).dictionary_encode()
    )
    combined = pa.concat_tables([good, bad])
    assert combined.column("mode").num_chunks == 2
    with pytest.raises(SchemaMismatchError, match=r"column 'mode': holds \['predict'\]"):
        validate_history(combined)
    validate_history(pa.concat_tables([good, good]))


def test_row_groups_checked_alone_report_what_the_whole_table_does(table: pa.Table) -> None:
    """``row_group_problems`` (a file read a row group at a time, ``ti validate``) merges the
    row groups' findings into the whole table's: counts added, first rows table-wide, offending
    values united, schema problems once."""
    from ti_schema.validate import HISTORY_CONTRACT, problems_for, row_group_problems

    ranks = table.column("rank").to_pylist()
    ranks[7] = ranks[40] = ranks[41] = -1
    signals = table.column("signal").to_pylist()
    signals[2], signals[50] = "activations", "weights"
    value = table.column("value").to_pylist()
    reason = table.column("unavailable_reason").to_pylist()
    available = [i for i, r in enumerate(reason) if r is None]
    for i in (available[3], available[-1]):
        reason[i] = "both set"
    broken = replace_column(table, "rank", table.schema.field("rank"), pa.array(ranks, pa.int32()))
    broken = replace_column(
        broken, "signal", table.schema.field("signal"), pa.array(signals, pa.string())
    )
    broken = replace_column(
        broken, "value", table.schema.field("value"), pa.array(value, pa.float64())
    )
    broken = replace_column(
        broken,
        "unavailable_reason",
        table.schema.field("unavailable_reason"),
        pa.array(reason, pa.string()),
    )
    broken = broken.append_column("extra", pa.array([1] * broken.num_rows))
    whole = problems_for(broken, HISTORY_CONTRACT)
    chunks = [broken.slice(start, 13) for start in range(0, broken.num_rows, 13)]
    merged = row_group_problems(iter(chunks), HISTORY_CONTRACT, broken.schema)
    assert sorted(map(str, merged)) == sorted(map(str, whole))
    text = "\n".join(map(str, merged))
    assert "column 'rank': 3 negative value(s), first at row 7" in text
    assert "holds ['activations', 'weights']" in text
    assert f"2 row(s), first at row {available[3]}" in text
    assert text.count("extra") == 1
    empty = row_group_problems(iter([]), HISTORY_CONTRACT, table.schema)
    assert empty == problems_for(table.schema.empty_table(), HISTORY_CONTRACT)
