"""TensorBoardSink with caller-owned writers: torch's SummaryWriter and Lightning's logger.

Sink-level: the sink is opened with ti-schema's example run and fed its example tables.
"""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from ti_io import TensorBoardSink, histogram_tag
from ti_schema.testing import example_histogram_table, example_history_table, example_run_info


def _load(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_caller_summary_writer_is_flushed_not_closed(tmp_path: Path) -> None:
    run = example_run_info()
    writer = SummaryWriter(str(tmp_path / "tb"))
    sink = TensorBoardSink(writer)
    sink.open(run)
    sink.write_history(example_history_table().to_batches()[0])  # ignored: scalars stay in Parquet
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
