"""The fidelity checks of ``_fidelity`` are proven here: a defect planted in the real write path
(``ti_io.write.parts.conform``, through which every stored row passes) must make them fail. Without
this, a check that compares nothing would pass on broken code as well as on good code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from _fidelity import HISTOGRAM_KEY, assert_result_json_matches, assert_rows_equal
from _io_helpers import Synth

import ti_io.write.parts
from ti_io import DirectorySink, HistoryConfig, consolidate, scan_history
from ti_schema.testing import load_strict_json

WINDOW = 3


def _plant(monkeypatch: pytest.MonkeyPatch, column: str, factor: float) -> None:
    """``conform`` as it would be with every stored ``column`` multiplied by ``factor``."""
    real = ti_io.write.parts.conform

    def scaled(batches: list[pa.RecordBatch], schema: pa.Schema) -> pa.Table:
        table = real(batches, schema)
        if column not in table.schema.names:
            return table
        index = table.schema.get_field_index(column)
        return table.set_column(
            index, table.schema.field(index), pc.multiply(table.column(column), factor)
        )

    monkeypatch.setattr(ti_io.write.parts, "conform", scaled)


def _run(out: Path, s: Synth, *, finalize: bool) -> dict[str, list[pa.RecordBatch]]:
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=40, window=WINDOW))
    sink.open(s.run)
    sent: dict[str, list[pa.RecordBatch]] = {"history": [], "histograms": []}
    for i in range(8):
        sent["history"].append(s.history(i, dictionary=i % 2 == 1))
        sent["histograms"].append(s.histograms(i))
        sink.write_history(sent["history"][-1])
        sink.write_histograms(sent["histograms"][-1])
    if finalize:
        sink.close()
    else:
        sink._flush_at_exit()  # killed after publishing parts: recovery reads them
    return sent


@pytest.mark.parametrize("planted", [False, True], ids=["intact", "values-x1.5"])
def test_stored_values_defect_is_caught(
    tmp_path: Path,
    synth: Callable[..., Synth],
    monkeypatch: pytest.MonkeyPatch,
    planted: bool,
) -> None:
    """Intact, every check passes; with stored values x1.5, each check (finalized history,
    live parts, recovered history, result.json) fails on its own."""
    if planted:
        _plant(monkeypatch, "value", 1.5)
    s = synth(empty_every=3, seed=11)
    sent = _run(tmp_path / "final", s, finalize=True)
    live = _run(tmp_path / "killed", s, finalize=False)
    checks: dict[str, Callable[[], object]] = {
        "final history": lambda: assert_rows_equal(
            pq.read_table(tmp_path / "final" / "history.parquet"), sent["history"]
        ),
        "final result.json": lambda: assert_result_json_matches(
            load_strict_json(tmp_path / "final" / "result.json"), sent["history"], WINDOW
        ),
        "live parts": lambda: assert_rows_equal(
            scan_history(tmp_path / "killed").collect().to_arrow(), live["history"]
        ),
    }
    outcomes = {name: _fails(check) for name, check in checks.items()}
    consolidate(tmp_path / "killed")
    outcomes["recovered history"] = _fails(
        lambda: assert_rows_equal(
            pq.read_table(tmp_path / "killed" / "history.parquet"), live["history"]
        )
    )
    outcomes["recovered result.json"] = _fails(
        lambda: assert_result_json_matches(
            load_strict_json(tmp_path / "killed" / "result.json"), live["history"], WINDOW
        )
    )
    assert outcomes == dict.fromkeys(outcomes, planted)


@pytest.mark.parametrize("planted", [False, True], ids=["intact", "sums-x1.5"])
def test_stored_histogram_defect_is_caught(
    tmp_path: Path,
    synth: Callable[..., Synth],
    monkeypatch: pytest.MonkeyPatch,
    planted: bool,
) -> None:
    if planted:
        _plant(monkeypatch, "sum", 1.5)
    s = synth(seed=12)
    sent = _run(tmp_path, s, finalize=True)
    stored = pq.read_table(tmp_path / "histograms.parquet")
    assert _fails(lambda: assert_rows_equal(stored, sent["histograms"], HISTOGRAM_KEY)) is planted


def _fails(check: Callable[[], object]) -> bool:
    try:
        check()
    except AssertionError:
        return True
    return False
