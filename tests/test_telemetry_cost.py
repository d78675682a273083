"""Every run's measured telemetry cost, end to end: ti-core measures it in the run, ti-io keeps
it in the run facts (run.json while live, the footer of history.parquet once finalized),
index.md and ``ti summary``'s header; a crashed run keeps the latest figure it was given."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from ti_core import EveryNForwardsSampler, inject_observer, observer_of, remove_observer
from ti_core.preemption import publish
from ti_io import DirectorySink, HistoryConfig, consolidate
from ti_io.cli import main as cli_main
from ti_io.facts import read_run_facts
from ti_schema import RunCost, parse_metadata, validate_history
from ti_schema.layout import HISTORY_PARTS, RUN_FILE


def _deep() -> nn.Module:
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)])


def _train(model: nn.Module, steps: int) -> None:
    x = torch.randn(4, 16)
    for _ in range(steps):
        model(x).square().mean().backward()


def test_the_figure_is_in_the_footer_index_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _deep()
    inject_observer(model, output_dir=tmp_path, sampler=EveryNForwardsSampler(3))
    _train(model, 45)
    remove_observer(model)
    footer = parse_metadata(pq.read_metadata(tmp_path / "history.parquet").metadata)
    validate_history(pq.read_schema(tmp_path / "history.parquet"))
    cost = RunCost.from_doc(footer["telemetry_cost"])
    assert cost is not None
    assert cost == read_run_facts(tmp_path).telemetry_cost
    samples = pq.read_table(tmp_path / "history.parquet", columns=["sample_id"])
    assert cost.sampled_forwards == len(set(samples.column(0).to_pylist())) == 15
    assert cost.unsampled_forwards == 30
    assert cost.measured_sampled_steps == 14
    # the run's own data: 40 measured layers make a sampled step dearer than an unsampled one
    assert cost.median_sampled_step_seconds is not None
    assert cost.median_unsampled_step_seconds is not None
    assert cost.median_sampled_step_seconds > cost.median_unsampled_step_seconds
    assert cost.telemetry_seconds is not None
    assert cost.telemetry_seconds > 0
    assert cost.fraction is not None
    assert 0 < cost.fraction < 1
    line = f"Telemetry cost: {cost.describe()}"
    index = (tmp_path / "index.md").read_text(encoding="utf-8").splitlines()
    assert next(i for i, text in enumerate(index) if text.startswith(line)) < 10  # near the top
    assert cli_main(["summary", str(tmp_path)]) == 0
    header = capsys.readouterr().out.splitlines()[:3]
    assert f"telemetry cost: {cost.describe()}" in header


def test_a_crashed_run_keeps_its_latest_figure(tmp_path: Path) -> None:
    model = _deep()
    sink = DirectorySink(tmp_path / "run", history_config=HistoryConfig(flush_seconds=None))
    inject_observer(model, sink=sink, output_dir=None, sampler=EveryNForwardsSampler(2))
    try:
        _train(model, 10)
        shutil.copytree(tmp_path / "run", tmp_path / "never-reported")
        observer = observer_of(model)
        assert observer is not None
        assert publish([observer], "test", timeout=None)  # what SIGTERM does
        shutil.copytree(tmp_path / "run", tmp_path / "killed")  # a kill -9 now
    finally:
        remove_observer(model)
    doc = json.loads((tmp_path / "killed" / HISTORY_PARTS / RUN_FILE).read_text("utf-8"))
    reported = RunCost.from_doc(doc["telemetry_cost"])
    assert reported is not None
    assert reported.sampled_forwards == 5
    consolidate(tmp_path / "killed", force=True)
    assert read_run_facts(tmp_path / "killed").telemetry_cost == reported
    index = (tmp_path / "killed" / "index.md").read_text(encoding="utf-8")
    assert f"Telemetry cost: {reported.describe()}" in index
    consolidate(tmp_path / "never-reported", force=True)
    assert read_run_facts(tmp_path / "never-reported").telemetry_cost is None
    index = (tmp_path / "never-reported" / "index.md").read_text(encoding="utf-8")
    assert "Telemetry cost: unknown" in index
