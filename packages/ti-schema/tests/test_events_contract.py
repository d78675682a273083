"""The ``ti.events`` table of contract 1.3: schema, data rules, and the sink capability."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pytest

import ti_schema
from ti_schema import SchemaMismatchError, SinkCapabilities, events_schema, validate_events


def _row(**changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "run_id": "r",
        "rank": 1,
        "event_id": 0,
        "kind": "nonfinite",
        "forward_index": 41,
        "timestamp": datetime(2026, 12, 2, tzinfo=UTC),
        "signal": "output",
        "layer": "blocks.3.attn",
        "module_type": "Attention",
        "tensor_path": "[0]",
        "layers": ["blocks.3.attn", "blocks.3.mlp"],
        "tensor_paths": ["[0]", ""],
        "reason": None,
        "value": None,
        "dense_first_forward": 42,
        "dense_forwards": 4,
    }
    row.update(changes)
    return row


def _table(*rows: dict[str, Any]) -> pa.Table:
    schema = events_schema("test")
    return pa.Table.from_pylist(list(rows), schema=schema)


def test_a_nonfinite_a_manual_and_a_loss_event_conform() -> None:
    manual = _row(
        kind="manual",
        signal=None,
        layer=None,
        module_type=None,
        tensor_path=None,
        layers=[],
        tensor_paths=[],
        reason="asked",
        event_id=1,
    )
    loss = {**manual, "kind": "loss", "value": 9.5, "event_id": 2}
    validate_events(_table(_row(), manual, loss))
    validate_events(ti_schema.empty_events("test"))
    assert ti_schema.EVENT_KINDS == ("nonfinite", "manual", "loss")
    assert list(events_schema().names) == list(ti_schema.EVENT_COLUMNS)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": "spike"}, "column 'kind': holds ['spike']"),
        ({"signal": "parameter"}, "column 'signal': holds ['parameter']"),
        ({"layer": None}, "name no signal or no first module"),
        ({"tensor_paths": ["[0]"]}, "lists of different lengths"),
        ({"dense_forwards": -1}, "column 'dense_forwards': 1 negative"),
    ],
)
def test_data_rules_name_what_is_wrong(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaMismatchError, match=r"ti\.events") as info:
        validate_events(_table(_row(), _row(**changes)))
    assert message in str(info.value)


def test_a_history_table_is_not_an_events_table() -> None:
    history = ti_schema.history_schema("test").empty_table()
    with pytest.raises(SchemaMismatchError, match=r"describes schema 'ti\.history'"):
        validate_events(history)


def test_the_write_events_capability_must_be_callable() -> None:
    assert SinkCapabilities().write_events is None
    with pytest.raises(TypeError, match=r"write_events=\.\.\.\) must be a callable"):
        SinkCapabilities(write_events="events.parquet")  # type: ignore[arg-type]
