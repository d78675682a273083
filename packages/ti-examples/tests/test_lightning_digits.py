"""Lightning on scikit-learn's digits: a real trainer, a real data set, a stated accuracy."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    SCALARS,
    EventAccumulator,
)

from ti_examples.lightning_digits import STATED_TEST_ACCURACY, run_lightning_digits
from ti_schema.testing import assert_artifact_dir_conforms


@pytest.mark.slow
def test_lightning_digits_reaches_its_accuracy_with_valid_artifacts(tmp_path: Path) -> None:
    result = run_lightning_digits(tmp_path, epochs=10, sample_every=10)

    # The docs state the measured accuracy; the floor leaves room for library changes.
    assert result.test_accuracy >= 0.9
    assert result.test_accuracy == pytest.approx(STATED_TEST_ACCURACY, abs=0.03)
    assert (result.train_size, result.test_size) == (1347, 450)

    assert_artifact_dir_conforms(result.stats_dir)
    history = pl.read_parquet(result.stats_dir / "history.parquet")
    assert set(history["layer"].unique()) == {"net.0", "net.1", "net.2"}
    # Training forwards are sampled in train mode; the test batches under trainer.test in eval.
    modes = history.group_by("mode").agg(pl.col("grad_enabled").unique())
    assert set(modes["mode"]) == {"train", "eval"}
    eval_grad = modes.filter(pl.col("mode") == "eval")["grad_enabled"].item().to_list()
    assert eval_grad == [False]
    assert history.filter(pl.col("mode") == "eval")["signal"].unique().to_list() == ["output"]

    # Our histograms went into Lightning's own logger, next to its scalars.
    events = EventAccumulator(str(result.logger_dir), size_guidance={HISTOGRAMS: 0, SCALARS: 0})
    events.Reload()
    assert "train_loss" in events.Tags()[SCALARS]
    histogram_tags = events.Tags()[HISTOGRAMS]
    assert any("net.0" in tag for tag in histogram_tags), histogram_tags


@pytest.mark.slow
def test_the_seed_lightning_pattern_writes_the_directory_and_the_logger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``inject_observer(model, sink=TensorBoardSink(logger))``, as torchinstruments 0.8.0's
    Lightning example attached: the supplied sink adds to the directory default, so a real
    Trainer run leaves ``stats/`` (valid artifacts) and histograms in Lightning's logger."""
    monkeypatch.chdir(tmp_path)
    result = run_lightning_digits(tmp_path, epochs=1, sample_every=5, default_stats_dir=True)
    assert result.stats_dir == tmp_path / "stats"
    assert_artifact_dir_conforms(result.stats_dir)
    history = pl.read_parquet(result.stats_dir / "history.parquet")
    assert set(history["layer"].unique()) == {"net.0", "net.1", "net.2"}
    assert set(history["signal"].unique()) == {"output", "output_gradient"}
    events = EventAccumulator(str(result.logger_dir), size_guidance={HISTOGRAMS: 0, SCALARS: 0})
    events.Reload()
    assert "train_loss" in events.Tags()[SCALARS]
    logger_tags = set(events.Tags()[HISTOGRAMS])
    own = EventAccumulator(str(result.stats_dir / "tensorboard"), size_guidance={HISTOGRAMS: 0})
    own.Reload()
    # the same histograms, in the logger and in the run directory's own events
    assert logger_tags == set(own.Tags()[HISTOGRAMS])
    assert "net.0/call0/output" in logger_tags
