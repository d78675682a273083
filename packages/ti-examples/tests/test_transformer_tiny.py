"""A tiny Hugging Face GPT-2 built from a config, trained with its own loop, observed passively."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from ti_examples.transformer_tiny import run_transformer_tiny
from ti_schema.testing import assert_artifact_dir_conforms


@pytest.mark.slow
def test_transformer_paths_and_artifacts(tmp_path: Path) -> None:
    result = run_transformer_tiny(tmp_path, steps=6, sample_every=2)
    assert result.losses[-1] < result.losses[0]
    assert_artifact_dir_conforms(result.stats_dir)

    history = pl.read_parquet(result.stats_dir / "history.parquet")
    paths = history.select("layer", "module_type", "signal", "tensor_path").unique()

    def tensor_paths(layer: str, signal: str) -> set[str]:
        rows = paths.filter((pl.col("layer") == layer) & (pl.col("signal") == signal))
        return set(rows["tensor_path"].to_list())

    # The model returns a ModelOutput (a dict): its tensors are addressed by key.
    assert tensor_paths("", "output") == {"['loss']", "['logits']"}
    assert "['logits']" in tensor_paths("", "output_gradient")
    root_type = paths.filter(pl.col("layer") == "")["module_type"].unique().to_list()
    assert root_type == ["GPT2LMHeadModel"]
    # Attention modules return a tuple; the attention output is its first element.
    for block in ("transformer.h.0", "transformer.h.1"):
        assert "[0]" in tensor_paths(f"{block}.attn", "output")
        assert "[0]" in tensor_paths(f"{block}.attn", "output_gradient")
        assert tensor_paths(f"{block}.mlp.c_fc", "output") == {""}
    # Three samples (forwards 0, 2, 4), every selected layer measured in each.
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2]
    logits_shape = history.filter(
        (pl.col("layer") == "") & (pl.col("tensor_path") == "['logits']")
    )["shape"][0].to_list()
    assert logits_shape == [16, 16, 64]


@pytest.mark.slow
def test_hf_trainer_run_observed_by_the_callback(tmp_path: Path) -> None:
    """The same model under transformers.Trainer with HFObserverCallback: artifacts in
    <output_dir>/stats, one sample every third micro-batch, the loss falling."""
    from ti_examples.hf_trainer_tiny import run_hf_trainer_tiny

    result = run_hf_trainer_tiny(tmp_path, steps=3, accumulation=2, sample_every=2)
    assert result.stats_dir == tmp_path / "stats"
    assert_artifact_dir_conforms(result.stats_dir)
    assert result.last_loss < result.first_loss
    history = pl.read_parquet(result.stats_dir / "history.parquet")
    # six micro-batches (three steps of two), every second one sampled
    assert history["forward_index"].unique().sort().to_list() == [0, 2, 4]
    assert set(history["mode"].unique()) == {"train"}
    assert {"output", "output_gradient"} <= set(history["signal"].unique())
