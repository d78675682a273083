"""Columnar record batches: exact schema, identity repeated per metric, nulls with reasons."""

from __future__ import annotations

import numpy as np
import pytest

from ti_core.emission.records import RunColumns, constant_strings, history_batch, unavailable_batch
from ti_core.entries import Entry
from ti_schema import histogram_schema, history_schema
from ti_schema.testing import assert_history_conforms

METRICS = ("mean", "p50", "boom")


def columns(n_layers: int) -> RunColumns:
    return RunColumns(
        history_schema("ti-core test"),
        histogram_schema("ti-core test"),
        "run1",
        3,
        tuple(f"blocks.{i}" for i in range(n_layers)),
        tuple("Linear" if i % 2 else "Identity" for i in range(n_layers)),
        METRICS,
    )


@pytest.mark.parametrize("n", [1, 7, 400])  # 400 entries x 3 metrics crosses the small/large path
def test_history_batch_matches_a_row_by_row_reference(n: int) -> None:
    run = columns(n)
    rng = np.random.default_rng(n)
    entries = [
        Entry(
            i,
            i % 3,
            f"[{i % 2}]",
            i % 2 == 0,
            i % 4 != 0,
            tuple(range(1, i % 4 + 1)),
            "float32",
            10**15 + i,
        )
        for i in range(n)
    ]
    values = rng.normal(size=(n, len(METRICS)))
    available = np.ones_like(values, dtype=bool)
    available[:, 2] = False
    reasons = [[None, None, f"failed {i}"] for i in range(n)]
    batch = history_batch(run, "output_gradient", 5, 9, entries, values, available, reasons)
    assert_history_conforms(batch)
    assert batch.schema.equals(run.history_schema, check_metadata=True)
    got = batch.to_pylist()
    assert len(got) == n * len(METRICS)
    for row_index, row in enumerate(got):
        i, j = divmod(row_index, len(METRICS))
        e = entries[i]
        assert row["run_id"] == "run1"
        assert (row["rank"], row["sample_id"], row["forward_index"]) == (3, 5, 9)
        assert row["layer"] == f"blocks.{i}"
        assert row["module_type"] == ("Linear" if i % 2 else "Identity")
        assert row["call_index"] == e.call_index
        assert row["signal"] == "output_gradient"
        assert row["tensor_path"] == e.path
        assert row["mode"] == ("train" if e.train else "eval")
        assert row["grad_enabled"] is e.grad_enabled
        assert row["shape"] == list(e.shape)
        assert row["dtype"] == "float32"
        assert int(row["timestamp"].timestamp() * 1e6) == pytest.approx(e.timestamp_us, abs=1)
        assert row["metric"] == METRICS[j]
        if j == 2:
            assert row["value"] is None
            assert row["unavailable_reason"] == f"failed {i}"
        else:
            assert row["value"] == values[i, j]
            assert row["unavailable_reason"] is None


def test_nan_values_and_missing_reasons_become_explained_nulls() -> None:
    run = columns(1)
    entry = Entry(0, 0, "", True, True, (2,), "float32", 1)
    values = np.array([[np.nan, 1.0, 2.0]])
    available = np.array([[True, True, False]])
    batch = history_batch(run, "output", 0, 0, [entry], values, available, [[None, None, None]])
    rows = batch.to_pylist()
    assert [r["value"] for r in rows] == [None, 1.0, None]
    assert rows[0]["unavailable_reason"]
    assert rows[2]["unavailable_reason"]
    assert rows[1]["unavailable_reason"] is None


def test_unavailable_batch_and_constant_strings() -> None:
    run = columns(2)
    entries = [Entry(1, 0, "", True, True, (), "int64", 1)]
    batch = unavailable_batch(run, "output_gradient", 1, 2, entries, ["gap"])
    assert_history_conforms(batch)
    assert {(r["value"], r["unavailable_reason"]) for r in batch.to_pylist()} == {(None, "gap")}
    assert constant_strings("", 3).to_pylist() == ["", "", ""]
    assert constant_strings("é\nx", 2).to_pylist() == ["é\nx", "é\nx"]
    assert constant_strings("a", 0).to_pylist() == []
