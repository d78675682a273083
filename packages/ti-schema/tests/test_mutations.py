"""Property: every random breakage of a valid table is caught, with the right kind of error."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ti_schema import (
    SchemaMismatchError,
    histogram_schema,
    history_schema,
    type_matches,
    validate_histograms,
    validate_history,
)
from ti_schema.testing import example_histogram_table, example_history_table

CANDIDATE_TYPES = [
    pa.int8(),
    pa.int32(),
    pa.int64(),
    pa.uint32(),
    pa.float32(),
    pa.float64(),
    pa.bool_(),
    pa.binary(),
    pa.string(),
    pa.date32(),
    pa.timestamp("ms", tz="UTC"),
    pa.timestamp("us"),
    pa.list_(pa.float64()),
    pa.list_(pa.int64()),
    pa.list_(pa.int32()),
    pa.struct([("a", pa.int64())]),
]

Mutation = tuple[str, Callable[[pa.Table], pa.Table]]


def _metadata(table: pa.Table, raw: bytes | None) -> pa.Table:
    return table.replace_schema_metadata(None if raw is None else {b"ti": raw})


@st.composite
def mutations(draw: st.DrawFn, table: pa.Table) -> Mutation:
    schema = table.schema
    column = draw(st.sampled_from(schema.names))
    index = schema.get_field_index(column)
    field = schema.field(index)
    kind = draw(st.sampled_from(["drop", "rename", "retype", "nullability", "metadata"]))
    if kind == "drop":
        return "missing_column", lambda t: t.remove_column(index)
    if kind == "rename":
        suffix = draw(st.text("abcxyz_0123456789", min_size=1, max_size=5))
        names = [n + suffix if n == column else n for n in schema.names]
        return "extra_column", lambda t: t.rename_columns(names)
    if kind == "retype":
        # Wrong relative to the contract, not to the drawn table: a dictionary-encoded column
        # retyped to plain string is still valid.
        contract = history_schema() if column in history_schema().names else histogram_schema()
        expected = contract.field(column).type
        wrong = draw(st.sampled_from([t for t in CANDIDATE_TYPES if not type_matches(t, expected)]))
        new_field = field.with_type(wrong)
        return "type", lambda t: t.set_column(index, new_field, pa.nulls(t.num_rows, wrong))
    if kind == "nullability":
        flipped = field.with_nullable(not field.nullable)
        return "nullability", lambda t: t.set_column(index, flipped, t.column(index))
    doc = json.loads(schema.metadata[b"ti"])
    corruption = draw(
        st.sampled_from(["drop", "bytes", "name", "version", "major", "producer", "key"])
    )
    if corruption == "drop":
        return "missing_metadata", lambda t: _metadata(t, None)
    if corruption == "bytes":
        # not JSON, not an object, or an object without the three keys
        raw = draw(st.binary(max_size=40).filter(lambda b: b != schema.metadata[b"ti"]))
        return "foreign_metadata", lambda t: _metadata(t, raw)
    if corruption == "name":
        name = draw(st.text(min_size=1, max_size=12).filter(lambda n: n != doc["schema"]))
        return "foreign_metadata", lambda t: _metadata(
            t, json.dumps({**doc, "schema": name}).encode()
        )
    if corruption == "version":
        version = draw(st.text(max_size=8).filter(lambda v: not v.startswith("1.") and v != ""))
        raw = json.dumps({**doc, "schema_version": version}).encode()
        return "unsupported_version", lambda t: _metadata(t, raw)
    if corruption == "major":
        major = draw(st.integers(0, 99).filter(lambda m: m != 1))
        minor = draw(st.integers(0, 99))
        raw = json.dumps({**doc, "schema_version": f"{major}.{minor}"}).encode()
        return "unsupported_version", lambda t: _metadata(t, raw)
    if corruption == "producer":
        producer = draw(st.sampled_from(["", None, 3, ["x"]]))
        raw = json.dumps({**doc, "producer": producer}).encode()
        return "foreign_metadata", lambda t: _metadata(t, raw)
    key = draw(st.sampled_from(["schema", "schema_version", "producer"]))
    raw = json.dumps({k: v for k, v in doc.items() if k != key}).encode()
    return "foreign_metadata", lambda t: _metadata(t, raw)


HISTORY = example_history_table(30)
HISTORY_DICT = example_history_table(30, dictionary=True)
HISTOGRAMS = example_histogram_table(4)


def _assert_caught(
    validate: Callable[[Any], None], table: pa.Table, mutation: Mutation, as_schema: bool
) -> None:
    expected, mutate = mutation
    validate(table)  # the unmutated table is valid
    broken = mutate(table)
    with pytest.raises(SchemaMismatchError) as info:
        validate(broken.schema if as_schema else broken)
    kinds = info.value.kinds
    if expected == "extra_column":
        assert {"missing_column", "extra_column"} <= kinds
    else:
        assert expected in kinds, str(info.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), as_schema=st.booleans(), dictionary=st.booleans())
def test_history_mutations_are_always_caught(
    data: st.DataObject, as_schema: bool, dictionary: bool
) -> None:
    table = HISTORY_DICT if dictionary else HISTORY
    _assert_caught(validate_history, table, data.draw(mutations(table)), as_schema)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), as_schema=st.booleans())
def test_histogram_mutations_are_always_caught(data: st.DataObject, as_schema: bool) -> None:
    _assert_caught(validate_histograms, HISTOGRAMS, data.draw(mutations(HISTOGRAMS)), as_schema)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_several_mutations_are_all_listed(data: st.DataObject) -> None:
    table = HISTORY
    columns = data.draw(
        st.lists(st.sampled_from(table.column_names), min_size=2, max_size=5, unique=True)
    )
    broken = table.drop_columns(columns)
    with pytest.raises(SchemaMismatchError) as info:
        validate_history(broken)
    missing = {m.where for m in info.value.mismatches if m.kind == "missing_column"}
    assert missing == {f"column {c!r}" for c in columns}
