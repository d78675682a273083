"""A signal added to a copy of the declaration flows through everything ti-schema derives from
it: the ``signal`` column's doc, the validators' allowed values per contract version, and
result.json's JSON Schema and validator."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from ti_schema import (
    DEFAULT_SIGNALS,
    PARAMETER_SIGNALS,
    SIGNAL_ADDED_IN,
    SIGNAL_DECLARATION,
    SIGNAL_DEFINITIONS,
    SIGNALS,
    SchemaMismatchError,
    SignalSpec,
    histogram_schema,
    history_schema,
    validate_histograms,
    validate_history,
    validate_result_json,
)
from ti_schema.result_json import RESULT_JSON_SCHEMA, result_json_schema
from ti_schema.testing import example_histogram_table, example_history_table
from ti_schema.version import SCHEMA_MINOR

NEW = SignalSpec(
    "residual", "a tensor of the residual stream at a selected module's call", SCHEMA_MINOR
)
EXTENDED = SIGNAL_DECLARATION.extended([NEW])


def _relabel(table: pa.Table, old: str, new: str) -> pa.Table:
    """``table`` with every ``signal`` value ``old`` replaced by ``new`` (schema kept)."""
    column = table.column("signal")
    relabeled = pc.if_else(pc.equal(column, old), new, column).cast(column.type)
    return table.set_column(
        table.schema.get_field_index("signal"), table.field("signal"), relabeled
    )


def _doc(schema: pa.Schema) -> str:
    return schema.field("signal").metadata[b"doc"].decode()


def test_the_named_constants_are_derived_from_the_declaration() -> None:
    assert SIGNAL_DECLARATION.names == SIGNALS
    assert DEFAULT_SIGNALS == ("output", "output_gradient")
    assert PARAMETER_SIGNALS == ("parameter", "parameter_gradient", "parameter_update")
    assert {s.name: s.added_in_minor for s in SIGNAL_DECLARATION} == SIGNAL_ADDED_IN
    assert {s.name: s.definition for s in SIGNAL_DECLARATION} == SIGNAL_DEFINITIONS
    assert _doc(history_schema()) == (
        "'output', 'output_gradient', 'parameter', 'parameter_gradient', 'parameter_update', "
        "'optimizer_state', 'attention' or 'input'"
    )


def test_a_declaration_refuses_a_signal_named_twice() -> None:
    with pytest.raises(ValueError, match="more than once"):
        SIGNAL_DECLARATION.extended([SignalSpec("output", "again", 0)])


def test_the_schemas_list_an_added_signal() -> None:
    for build in (history_schema, histogram_schema):
        assert "'residual'" in _doc(build(signals=EXTENDED))
        assert "'residual'" not in _doc(build())
        assert build(signals=EXTENDED).equals(build())  # the same columns and types


def test_the_validators_accept_an_added_signal_only_with_its_declaration() -> None:
    history = _relabel(example_history_table(), "output", "residual")
    histograms = _relabel(example_histogram_table(), "output", "residual")
    with pytest.raises(SchemaMismatchError, match="allowed values"):
        validate_history(history)
    with pytest.raises(SchemaMismatchError, match="allowed values"):
        validate_histograms(histograms)
    validate_history(history, signals=EXTENDED)
    validate_histograms(histograms, signals=EXTENDED)


def test_the_validators_apply_an_added_signals_contract_version() -> None:
    """Data of this contract version may not hold a signal a later minor adds."""
    later = SIGNAL_DECLARATION.extended([SignalSpec("residual", NEW.definition, SCHEMA_MINOR + 1)])
    history = _relabel(example_history_table(), "output", "residual")
    with pytest.raises(SchemaMismatchError, match=rf"signals of contract 1\.{SCHEMA_MINOR + 1}"):
        validate_history(history, signals=later)


def _result_with(signal: str) -> list[dict[str, Any]]:
    stat = {
        "observations": 2,
        "unavailable": 0,
        **dict.fromkeys(
            ("mean", "std", "min", "p25", "p50", "p75", "max", "previous_window_mean"), 0.5
        ),
        "recent_window_mean": 0.5,
        "unavailable_reason": None,
    }
    tensor = {
        "call_index": 0,
        "signal": signal,
        "tensor_path": "",
        "mode": "train",
        "grad_enabled": True,
        "latest_shape": [4],
        "dtype": "float32",
        "statistics": {"mean": stat},
    }
    return [{"layer": "fc", "type": "Linear", "aliases": [], "tensors": [tensor]}]


def test_result_json_follows_an_added_signal() -> None:
    schema = result_json_schema(EXTENDED)
    assert schema["$defs"]["tensor"]["properties"]["signal"]["enum"] == [*SIGNALS, "residual"]
    assert result_json_schema() == RESULT_JSON_SCHEMA
    doc = _result_with("residual")
    jsonschema.validate(doc, schema)
    validate_result_json(doc, signals=EXTENDED)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(copy.deepcopy(doc), RESULT_JSON_SCHEMA)
    with pytest.raises(SchemaMismatchError, match="allowed"):
        validate_result_json(doc)
