"""TensorBoardSink with caller-owned writers: torch's SummaryWriter and Lightning's logger.

Sink-level: the sink is opened with ti-schema's example run and fed its example tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from ti_core import AlwaysSampler, inject_observer, remove_observer
from ti_io import DirectorySink, TensorBoardSink, histogram_tag
from ti_io.write.tags import scalar_tag
from ti_schema.testing import example_histogram_table, example_history_table, example_run_info


def _load(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_caller_summary_writer_is_flushed_not_closed(tmp_path: Path) -> None:
    run = example_run_info()
    writer = SummaryWriter(str(tmp_path / "tb"))
    sink = TensorBoardSink(writer, scalars=False)
    sink.open(run)
    sink.write_history(example_history_table().to_batches()[0])  # scalars=False: Parquet only
    sink.write_histograms(example_histogram_table(6).to_batches()[0])
    sink.close()
    writer.add_scalar("after/removal", 3.5, global_step=7)  # still usable
    writer.flush()
    acc = _load(tmp_path / "tb")
    assert set(acc.Tags()["histograms"]) == {
        histogram_tag(layer, 0, signal, "")
        for layer in run.focus_layers
        for signal in ("output", "output_gradient")
    }
    assert [(e.step, e.value) for e in acc.Scalars("after/removal")] == [(7, 3.5)]
    writer.close()


def test_lightning_logger_experiment_is_used(tmp_path: Path) -> None:
    from lightning.pytorch import loggers

    logger = loggers.TensorBoardLogger(str(tmp_path), name="lt", version=0)
    run = example_run_info()
    sink = TensorBoardSink(logger)
    sink.open(run)
    sink.write_histograms(example_histogram_table(6).to_batches()[0])
    sink.close()
    logger.experiment.add_scalar("still/open", 1.0, 0)
    logger.experiment.flush()
    acc = _load(Path(logger.log_dir))
    assert len(acc.Tags()["histograms"]) == 2 * len(run.focus_layers)
    assert acc.Scalars("still/open")[0].value == 1.0


def _scalars(acc: EventAccumulator) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _train(model: nn.Module, sink: Any = None, *, output_dir: Any = None) -> None:
    options: dict[str, Any] = {"sink": sink} if sink is not None else {}
    inject_observer(
        model,
        output_dir=output_dir,
        sampler=AlwaysSampler(),
        histogram_selector=["0"],
        handle_sigterm=False,
        **options,
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
    remove_observer(model)


@pytest.mark.parametrize("where", ["directory", "summary_writer"])
def test_focus_layers_metrics_are_scalars_equal_to_the_history(tmp_path: Path, where: str) -> None:
    """Every available metric of the focus layer's rows is a scalar, tagged
    layer/call/signal/metric at step = sample_id, equal to history.parquet's value (float32);
    other layers have none. Read back with TensorBoard's own reader."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    run_dir = tmp_path / "run"
    if where == "directory":
        _train(model, output_dir=run_dir)
        logdir = run_dir / "tensorboard"
    else:
        writer = SummaryWriter(str(tmp_path / "tb"))
        _train(model, TensorBoardSink(writer), output_dir=run_dir)
        writer.close()
        logdir = tmp_path / "tb"
    history = pl.read_parquet(run_dir / "history.parquet")
    focus = history.filter(pl.col("layer") == "0", pl.col("value").is_not_null())
    scalars = _scalars(_load(logdir))
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in focus.sort("sample_id").iter_rows(named=True):
        tag = scalar_tag("0", row["call_index"], row["signal"], row["tensor_path"], row["metric"])
        expected.setdefault(tag, []).append((row["sample_id"], row["value"]))
    assert set(scalars) == set(expected)
    assert "0/call0/output/std" in scalars
    for tag, points in expected.items():
        got = scalars[tag]
        assert [step for step, _ in got] == [step for step, _ in points] == [0, 1, 2]
        np.testing.assert_allclose(
            [v for _, v in got], np.float32([v for _, v in points]), rtol=1e-6, err_msg=tag
        )


def test_scalars_can_be_turned_off(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    _train(model, DirectorySink(tmp_path / "run", tensorboard_scalars=False))
    acc = _load(tmp_path / "run" / "tensorboard")
    assert acc.Tags()["histograms"]
    assert acc.Tags()["scalars"] == []
    with pytest.raises(TypeError, match=r"tensorboard_scalars=\.\.\.\) must be True or False"):
        DirectorySink(tmp_path / "x", tensorboard_scalars="yes")  # type: ignore[arg-type]
