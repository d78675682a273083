"""One row order for a run's tables (``ti_io.read.ordering``): result.json, ``ti summary`` and
``ti compare`` list layers as the catalog does, signals in the contract's order, metrics in the
run's order with custom metrics after."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import polars as pl
import pytest

from ti_io import DirectorySink, compare_runs
from ti_io.cli import main
from ti_io.read.ordering import GROUP_KEYS, ordered
from ti_io.read.summary import summary_table
from ti_schema import DEFAULT_METRICS, SIGNALS
from ti_schema.layout import RESULT_FILE
from ti_schema.testing import example_history_table, example_run_info


def _rows(**columns: Sequence[object]) -> pl.DataFrame:
    n = len(next(iter(columns.values())))
    base: dict[str, Sequence[object]] = {
        "layer": ["a"] * n,
        "call_index": [0] * n,
        "signal": ["output"] * n,
        "tensor_path": [""] * n,
        "mode": ["train"] * n,
        "grad_enabled": [True] * n,
        "metric": ["mean"] * n,
    }
    return pl.DataFrame({**base, **columns})


def test_signals_follow_the_declared_order_not_the_alphabet() -> None:
    # The contract's order is not the alphabet's (optimizer_state, 1.5, comes last), and a
    # declaration in another order shows that the order is the declaration's.
    assert list(SIGNALS) != sorted(SIGNALS)
    declared = ["parameter_update", "output", "parameter", "output_gradient"]
    table = _rows(signal=sorted(declared))
    assert ordered(table, signals=declared)["signal"].to_list() == declared
    assert ordered(table)["signal"].to_list() == sorted(declared)
    both = _rows(signal=["optimizer_state", "output"])
    assert ordered(both)["signal"].to_list() == ["output", "optimizer_state"]


def test_layers_follow_the_catalog_then_names_and_metrics_the_run_then_custom_ones() -> None:
    table = _rows(
        layer=["z", "b", "a", "a", "a", "a"],
        metric=["mean", "mean", "zeta_custom", "alpha_custom", "max", "std"],
    )
    out = ordered(table, layers=["z"], metrics=["std", "max"])
    assert out.select("layer", "metric").rows() == [
        ("z", "mean"),  # in the catalog: first
        ("a", "std"),  # then by name; the run's metrics in its order
        ("a", "max"),
        ("a", "alpha_custom"),  # metrics the run does not list: after, by name
        ("a", "zeta_custom"),
        ("b", "mean"),
    ]
    # without the run's metrics: the contract's default profile
    default = ordered(_rows(metric=list(reversed(DEFAULT_METRICS))))
    assert default["metric"].to_list() == list(DEFAULT_METRICS)


def _run(directory: Path, *, live: bool) -> Path:
    """A run holding every signal, written in the reverse of the contract's order."""
    sink = DirectorySink(directory)
    sink.open(example_run_info())
    table = example_history_table(400, signals=list(reversed(SIGNALS)))
    for batch in table.to_batches():
        sink.write_history(batch)
    if live:
        sink.flush()
    else:
        sink.close()
    return directory


def _result_json_order(directory: Path) -> list[tuple[str, str, str, str]]:
    records = json.loads((directory / RESULT_FILE).read_text(encoding="utf-8"))
    return [
        (record["layer"], tensor["signal"], tensor["tensor_path"], metric)
        for record in records
        for tensor in record["tensors"]
        for metric in tensor["statistics"]
    ]


def test_summary_compare_and_result_json_list_rows_in_one_order(tmp_path: Path) -> None:
    first = _run(tmp_path / "a", live=False)
    second = _run(tmp_path / "b", live=False)
    want = _result_json_order(first)
    assert {signal for _, signal, _, _ in want} == set(SIGNALS)
    signals = list(dict.fromkeys(signal for layer, signal, _, _ in want if layer == "head"))
    assert signals == [s for s in SIGNALS if s in signals]
    summary = summary_table(first).filter(pl.col("executed"))
    assert summary.select("layer", "signal", "tensor_path", "metric").rows() == want
    compared = compare_runs([first, second]).filter(pl.col("run") == "a")
    assert compared.select("layer", "signal", "tensor_path", "metric").rows() == want
    assert compared.select(GROUP_KEYS).rows() == summary.select(GROUP_KEYS).rows()


def test_ti_summary_prints_signals_in_the_contracts_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _run(tmp_path / "live", live=True)
    assert main(["summary", str(directory), "--csv", "--layer", "head"]) == 0
    frame = pl.read_csv(capsys.readouterr().out.encode())
    signals = frame["signal"].unique(maintain_order=True).to_list()
    assert signals == [s for s in SIGNALS if s in signals]
    assert len(signals) == len(SIGNALS)
