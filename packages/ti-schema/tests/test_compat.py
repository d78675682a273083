"""The reader compatibility rule and the metadata helpers."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest

import ti_schema
from ti_schema import (
    SCHEMA_VERSION,
    SchemaMismatchError,
    check_compatible,
    parse_metadata,
    parse_version,
    validate_histograms,
    validate_history,
)
from ti_schema.testing import example_histogram_table, example_history_table
from ti_schema.validate import Contract, problems_for


def at_version(table: pa.Table, version: str) -> pa.Table:
    doc = parse_metadata(table)
    doc["schema_version"] = version
    return table.replace_schema_metadata({b"ti": json.dumps(doc).encode()})


def test_schema_version_is_parsable_and_known() -> None:
    assert parse_version(SCHEMA_VERSION) == (1, 5)
    assert ti_schema.KNOWN_VERSIONS["ti.history"] == ("1.0", "1.1", "1.2", "1.3", "1.4", "1.5")
    assert ti_schema.KNOWN_VERSIONS["ti.histograms"] == ("1.0", "1.1", "1.2", "1.3", "1.4", "1.5")
    assert ti_schema.KNOWN_VERSIONS["ti.events"] == ("1.3", "1.4", "1.5")


@pytest.mark.parametrize("bad", ["1", "1.0.0", "01.0", "1.x", " 1.0", "", 1.0])
def test_parse_version_refuses_anything_but_major_minor(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"major\.minor"):
        parse_version(bad)


def test_parse_metadata_reads_every_carrier() -> None:
    table = example_history_table(producer="acme-sink 3.1")
    expected = {"schema": "ti.history", "schema_version": "1.5", "producer": "acme-sink 3.1"}
    assert parse_metadata(table) == expected
    assert parse_metadata(table.schema) == expected
    assert parse_metadata(table.to_batches()[0]) == expected
    assert parse_metadata(dict(table.schema.metadata)) == expected
    assert parse_metadata({"ti": table.schema.metadata[b"ti"].decode()}) == expected


def test_parse_metadata_raises_for_missing_or_unparsable() -> None:
    with pytest.raises(SchemaMismatchError, match="no 'ti' key") as info:
        parse_metadata(pa.schema([("a", pa.int64())]))
    assert info.value.kinds == {"missing_metadata"}
    with pytest.raises(SchemaMismatchError, match="not valid JSON"):
        parse_metadata({b"ti": b"{"})
    with pytest.raises(TypeError, match="metadata source must be"):
        parse_metadata(42)  # type: ignore[arg-type]


def test_default_producer_names_the_distribution() -> None:
    producer = parse_metadata(ti_schema.history_schema())["producer"]
    assert producer.startswith("ti-schema ")


@pytest.mark.parametrize("version", ["1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.17"])
def test_same_major_is_compatible(version: str) -> None:
    table = at_version(example_history_table(), version)
    assert check_compatible(table) == parse_version(version)
    validate_history(table)


@pytest.mark.parametrize(
    ("version", "advice"),
    [("2.0", "upgrade ti-schema"), ("0.9", "older ti-schema that wrote it")],
)
def test_another_major_is_refused_naming_the_known_versions(version: str, advice: str) -> None:
    table = at_version(example_history_table(), version)
    with pytest.raises(SchemaMismatchError) as info:
        check_compatible(table)
    message = str(info.value)
    assert f"ti.history {version} cannot be read" in message
    assert "this reader knows ti.history 1.x (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)" in message
    assert advice in message
    with pytest.raises(SchemaMismatchError) as info:
        validate_history(table.drop_columns(["layer"]))
    # the columns of another major mean nothing to this reader: only the version is reported
    assert [m.kind for m in info.value.mismatches] == ["unsupported_version"]


def test_check_compatible_refuses_foreign_and_missing_metadata() -> None:
    with pytest.raises(SchemaMismatchError, match=r"describes schema 'ti\.history'"):
        check_compatible(example_history_table(), "ti.histograms")
    assert check_compatible(example_histogram_table(), "ti.histograms") == (1, 5)
    with pytest.raises(SchemaMismatchError) as info:
        check_compatible(pa.schema([]))
    assert info.value.kinds == {"missing_metadata"}


def test_schema_names_outside_the_contract_are_refused() -> None:
    with pytest.raises(ValueError, match=r"check_compatible\(expected\) must be one of"):
        check_compatible(example_history_table(), "ti.histroy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"schema_metadata\(schema_name\) must be one of"):
        ti_schema.schema_metadata("history")  # type: ignore[arg-type]
    assert ti_schema.SCHEMA_NAMES == (ti_schema.HISTORY, ti_schema.HISTOGRAMS, ti_schema.EVENTS)


def test_newer_minor_may_add_nullable_columns() -> None:
    table = at_version(example_history_table(), "1.6")
    grown = table.append_column(
        pa.field("device", pa.string()), pa.nulls(table.num_rows, pa.string())
    )
    validate_history(grown)
    validate_history(grown.schema)
    with pytest.raises(SchemaMismatchError) as info:
        validate_history(at_version(grown, "1.5"))
    assert "column 'device': is not part of ti.history 1.5" in str(info.value)


def test_newer_minor_may_not_add_not_null_columns() -> None:
    table = at_version(example_history_table(), "1.6")
    field = pa.field("device", pa.string(), nullable=False)
    grown = table.append_column(field, pa.array(["cpu"] * table.num_rows))
    with pytest.raises(SchemaMismatchError) as info:
        validate_history(grown)
    assert info.value.kinds == {"extra_column"}
    assert "a newer minor may only add nullable columns" in str(info.value)


def test_newer_minor_may_not_drop_or_retype_columns() -> None:
    table = at_version(example_history_table(), "1.6").drop_columns(["dtype"])
    with pytest.raises(SchemaMismatchError) as info:
        validate_history(table)
    assert info.value.kinds == {"missing_column"}


def test_histograms_follow_the_same_rule() -> None:
    table = at_version(example_histogram_table(), "1.6")
    validate_histograms(
        table.append_column(pa.field("p99", pa.float64()), pa.nulls(6, pa.float64()))
    )
    known = r"knows ti.histograms 1.x \(1.0, 1.1, 1.2, 1.3, 1.4, 1.5\)"
    with pytest.raises(SchemaMismatchError, match=known):
        validate_histograms(at_version(table, "3.0"))


def test_older_minor_may_lack_the_columns_added_after_it() -> None:
    # A hypothetical 1.6 reader whose contract added a nullable `device` column in 1.6.
    base = ti_schema.history_schema("test")
    grown = base.append(pa.field("device", pa.string()))
    reader = Contract("ti.history", grown, version=(1, 6), added_in={"device": 6})
    old = example_history_table()  # written at 1.5, no device column
    assert problems_for(old, reader) == []
    at_16 = at_version(old, "1.6")
    assert [m.kind for m in problems_for(at_16, reader)] == ["missing_column"]
    assert [m.kind for m in problems_for(old.replace_schema_metadata(None), reader)] == [
        "missing_metadata",
        "missing_column",
    ]


def test_run_facts_are_optional_metadata_keys_of_1_1() -> None:
    schema = ti_schema.history_schema(
        "ti-io 0.2.0",
        window=7,
        upgraded_from="torchinstruments 0.8.0",
        unrecorded=["mode", "run_id", "grad_enabled"],
    )
    doc = parse_metadata(schema)
    assert doc["window"] == 7
    assert doc["upgraded_from"] == "torchinstruments 0.8.0"
    assert doc["unrecorded"] == ["run_id", "mode", "grad_enabled"]  # contract order
    table = example_history_table().replace_schema_metadata(schema.metadata)
    validate_history(table)
    assert check_compatible(table) == (1, 5)
    # a 1.0 file has none of them and stays readable
    assert "window" not in parse_metadata(ti_schema.history_schema())
    validate_history(at_version(example_history_table(), "1.0"))


@pytest.mark.parametrize(
    ("facts", "message"),
    [
        ({"window": 0}, "'window' must be an int >= 1"),
        ({"window": "20"}, "'window' must be an int >= 1"),
        ({"upgraded_from": ""}, "'upgraded_from' must be a non-empty string"),
        ({"unrecorded": ["value"]}, "'unrecorded' must be a list drawn from"),
        ({"unrecorded": "mode"}, "'unrecorded' must be a list drawn from"),
    ],
)
def test_malformed_run_facts_are_refused(facts: dict[str, Any], message: str) -> None:
    table = example_history_table()
    doc = {**parse_metadata(table), **facts}
    broken = table.replace_schema_metadata({b"ti": json.dumps(doc).encode()})
    with pytest.raises(SchemaMismatchError, match=message) as info:
        validate_history(broken)
    assert info.value.kinds == {"foreign_metadata"}
    with pytest.raises(SchemaMismatchError, match=message):
        check_compatible(broken)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "window= must be a positive int"),
        ({"upgraded_from": ""}, "upgraded_from= must be a non-empty string"),
        ({"unrecorded": ["value"]}, "only .* may be marked unrecorded"),
    ],
)
def test_writing_malformed_run_facts_raises(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ti_schema.history_schema("p", **kwargs)


def test_parameter_signals_are_values_of_1_2() -> None:
    """Contract 1.2 adds the three parameter signals; a file that says 1.0 or 1.1 holds only
    the signals of its version, and data of a newer minor may hold signals this reader does
    not know yet."""
    assert ti_schema.SIGNALS == (
        "output",
        "output_gradient",
        "parameter",
        "parameter_gradient",
        "parameter_update",
        "optimizer_state",
        "attention",
        "input",
    )
    assert ti_schema.SIGNALS[:5] == ti_schema.DEFAULT_SIGNALS + ti_schema.PARAMETER_SIGNALS
    assert {s for s, minor in ti_schema.SIGNAL_ADDED_IN.items() if minor == 2} == set(
        ti_schema.PARAMETER_SIGNALS
    )
    assert ti_schema.SIGNAL_ADDED_IN["optimizer_state"] == 5
    assert ti_schema.SIGNAL_ADDED_IN["attention"] == 5
    assert ti_schema.SIGNAL_ADDED_IN["input"] == 5
    table = example_history_table(rows=400, signals=ti_schema.SIGNALS[:5])
    assert set(table.column("signal").to_pylist()) == set(ti_schema.SIGNALS[:5])
    assert set(table.column("tensor_path").to_pylist()) == {"", "weight", "bias"}
    validate_history(table)
    validate_history(at_version(table, "1.6"))
    for old in ("1.0", "1.1"):
        with pytest.raises(SchemaMismatchError) as info:
            validate_history(at_version(table, old))
        assert info.value.kinds == {"data"}
        message = str(info.value)
        assert "['parameter', 'parameter_gradient', 'parameter_update']" in message
        assert f"the data says version {old}" in message
        assert "schema_version 1.2 or later" in message
    # optimizer_state is a value of 1.5: a 1.4 file holding it is refused
    states = example_history_table(rows=120, signals=("output", "optimizer_state"))
    assert "weight.exp_avg" in set(states.column("tensor_path").to_pylist())
    validate_history(states)
    with pytest.raises(SchemaMismatchError, match=r"\['optimizer_state'\]"):
        validate_history(at_version(states, "1.4"))
    # the outputs-only rows of a 1.0 or 1.1 file stay valid
    validate_history(at_version(example_history_table(rows=400), "1.0"))
    validate_history(at_version(example_history_table(rows=400), "1.1"))


def test_unknown_signals_are_refused_up_to_this_reader_and_accepted_beyond() -> None:
    table = example_history_table(rows=9)
    renamed = table.set_column(
        table.schema.get_field_index("signal"),
        table.schema.field("signal"),
        pa.array(["module_input"] * 9),
    )
    with pytest.raises(SchemaMismatchError, match=r"holds \['module_input'\]; allowed values"):
        validate_history(renamed)
    validate_history(at_version(renamed, "1.6"))  # a newer minor may add signal values
    histograms = at_version(example_histogram_table(), "1.1")
    bad = histograms.set_column(
        histograms.schema.get_field_index("signal"),
        histograms.schema.field("signal"),
        pa.array(["parameter"] * histograms.num_rows),
    )
    with pytest.raises(SchemaMismatchError, match=r"the data says version 1\.1"):
        validate_histograms(bad)
    validate_histograms(at_version(bad, "1.3"))


def test_example_tables_refuse_unknown_signals() -> None:
    with pytest.raises(ValueError, match="signals must be a non-empty sequence"):
        example_history_table(signals=("output", "weights"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="signals must be a non-empty sequence"):
        example_history_table(signals="output")  # type: ignore[arg-type]
