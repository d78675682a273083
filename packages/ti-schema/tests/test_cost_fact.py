"""The ``telemetry_cost`` run fact (contract 1.4): RunCost, its JSON object, its validation."""

from __future__ import annotations

import json

import pytest

import ti_schema
from ti_schema import RunCost, parse_metadata, validate_history
from ti_schema.errors import SchemaMismatchError
from ti_schema.testing import example_history_table


def _cost(**changes: object) -> RunCost:
    values: dict[str, object] = {
        "sampled_forwards": 5,
        "unsampled_forwards": 95,
        "measured_sampled_steps": 4,
        "wall_seconds": 2.0,
        "telemetry_seconds": 0.02,
        "fraction": 0.01,
        "median_unsampled_step_seconds": 0.012,
        "median_sampled_step_seconds": 0.017,
    }
    values.update(changes)
    return RunCost(**values)  # type: ignore[arg-type]


def test_cost_round_trips_through_the_footer_and_validates() -> None:
    cost = _cost()
    schema = ti_schema.history_schema("ti-io 0.2.0", window=3, telemetry_cost=cost)
    doc = parse_metadata(schema)
    assert RunCost.from_doc(doc["telemetry_cost"]) == cost
    assert doc["telemetry_cost"]["method"] == ti_schema.COST_METHOD
    validate_history(example_history_table().replace_schema_metadata(schema.metadata))
    assert "telemetry_cost" in ti_schema.OPTIONAL_KEYS
    assert cost.describe().startswith("1 % of 2 s wall time (sampled steps cost 5 ms more")


def test_a_malformed_cost_fact_is_reported() -> None:
    table = example_history_table()
    doc = parse_metadata(table)
    doc["telemetry_cost"] = {"fraction": "a lot"}
    with pytest.raises(SchemaMismatchError, match="'telemetry_cost' lacks"):
        validate_history(table.replace_schema_metadata({b"ti": json.dumps(doc).encode()}))
    doc["telemetry_cost"] = {**_cost().to_doc(), "wall_seconds": -1.0}
    with pytest.raises(SchemaMismatchError, match="'telemetry_cost' holds invalid values"):
        validate_history(table.replace_schema_metadata({b"ti": json.dumps(doc).encode()}))


def test_cost_arguments_are_checked_and_unknown_figures_say_so() -> None:
    with pytest.raises(ValueError, match="sampled_forwards"):
        _cost(sampled_forwards=-1)
    with pytest.raises(TypeError, match="fraction"):
        _cost(fraction="1%")
    unknown = _cost(telemetry_seconds=None, fraction=None, median_sampled_step_seconds=None)
    assert unknown.describe().startswith("not measured over 2 s wall time")
    assert RunCost.from_doc(unknown.to_doc()) == unknown
    assert RunCost.from_doc([1, 2]) is None
    # signed: telemetry cheaper than the steps' own spread
    assert _cost(telemetry_seconds=-0.001, fraction=-0.0005).fraction == -0.0005
