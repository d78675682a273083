"""HFObserverCallback in a real ``transformers.Trainer`` on the CPU, on a tiny GPT-2 built from a
config (nothing downloaded): gradient accumulation, gradient checkpointing, evaluation during
training, a Trainer that raises, and the default flight recorder naming a poisoned attention
projection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from _trainer_helpers import assert_clean, history, hook_counts
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from ti_core import AlwaysSampler
from ti_io import read_events
from ti_schema.testing import assert_artifact_dir_conforms
from ti_trainers import HFObserverCallback


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def token_rows(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, 64, (12,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def arguments(output_dir: Path, **kwargs: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    settings.update(kwargs)
    return TrainingArguments(**settings)


class HooksAtTrainBegin(TrainerCallback):
    """Placed before the observer's callback: the model's hooks once the Trainer has set it up
    (gradient checkpointing adds a hook of its own), which is what removal must leave."""

    counts: dict[str, tuple[int, int, int, int, bool]] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.counts = hook_counts(kwargs["model"])


def test_accumulation_checkpointing_and_evaluation(tmp_path: Path) -> None:
    """Two optimizer steps of two micro-batches each, checkpointed blocks, one evaluation batch
    after each step: every root forward is one sample, recomputation adds none."""
    model = tiny_gpt2()
    hooks = HooksAtTrainBegin()
    reference: list[tuple[bool, np.ndarray]] = []  # lm_head output at each call (not checkpointed)
    handle = model.lm_head.register_forward_hook(
        lambda m, a, out: reference.append((m.training, out.detach().double().numpy()))
    )
    callback = HFObserverCallback(sampler=AlwaysSampler())
    args = arguments(
        tmp_path / "out",
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        # transformers 4.44 (the floor) checkpoints reentrantly unless told; reentrant blocks
        # give gradient rows that are unavailable with a reason (docs/capture.md)
        gradient_checkpointing_kwargs={"use_reentrant": False},
        eval_strategy="steps",
        eval_steps=1,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=token_rows(8),
        eval_dataset=token_rows(2, seed=1),
        callbacks=[hooks, callback],
    )
    trainer.train()
    assert hooks.counts is not None
    assert_clean(model, hooks.counts)  # the reference hook is still on, as at train begin
    handle.remove()

    stats = tmp_path / "out" / "stats"
    assert callback.output_dir == stats
    assert_artifact_dir_conforms(stats)

    rows = history(stats)
    head = rows.filter(
        (pl.col("layer") == "lm_head")
        & (pl.col("signal") == "output")
        & (pl.col("metric") == "std")
    ).sort("forward_index")
    # micro-batches 0, 1, evaluation, micro-batches 2, 3, evaluation
    assert [training for training, _ in reference] == [True, True, False, True, True, False]
    assert head.get_column("forward_index").to_list() == list(range(6))
    assert head.get_column("mode").to_list() == ["train", "train", "eval"] * 2
    for value, (_, output) in zip(head.get_column("value"), reference, strict=True):
        assert value == pytest.approx(np.std(output), rel=1e-5)

    # inside a checkpointed block: one output row per sample (the recomputation is not a
    # sample) and real gradients on the training samples
    block = rows.filter(
        (pl.col("layer") == "transformer.h.0.mlp.c_fc") & (pl.col("metric") == "std")
    )
    outputs = block.filter(pl.col("signal") == "output")
    assert outputs.get_column("sample_id").sort().to_list() == list(range(6))
    grads = block.filter(pl.col("signal") == "output_gradient")
    assert sorted(grads.get_column("forward_index").to_list()) == [0, 1, 3, 4]
    assert grads.get_column("value").null_count() == 0
    assert (grads.get_column("value") > 0).all()


class Explode(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom after the first step")


def test_after_an_exception_remove_finalizes_and_unhooks(tmp_path: Path) -> None:
    model = tiny_gpt2()
    before = hook_counts(model)
    callback = HFObserverCallback(sampler=AlwaysSampler())
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path / "out"),
        train_dataset=token_rows(4),
        callbacks=[callback, Explode()],
    )
    try:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()
    finally:
        callback.remove()
    assert_clean(model, before)
    assert_artifact_dir_conforms(tmp_path / "out" / "stats")
    assert history(tmp_path / "out" / "stats").get_column("forward_index").unique().to_list() == [0]


class PoisonAttention(TrainerCallback):
    """From optimizer step ``first`` on, block 1's attention projection (``c_attn``) returns
    an infinity: what a bad kernel or an overflow there would do, in every call, replays
    included."""

    def __init__(self, model: GPT2LMHeadModel, first: int) -> None:
        self.on = False
        self.first = first
        self.handle = model.transformer.h[1].attn.c_attn.register_forward_hook(self.poison)

    def poison(self, module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not self.on:
            return None
        output = output.clone()
        output[..., 0] = float("inf")
        return output

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.on = state.global_step >= self.first


def test_the_default_sentinel_names_a_poisoned_attention_projection_of_gpt2(
    tmp_path: Path,
) -> None:
    """GPT-2 from a config with SDPA attention, trained by the Trainer with the callback's
    defaults: the sentinel is on, detects at the root, and its replay names the projection."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(config)
    poison = PoisonAttention(model, first=2)
    callback = HFObserverCallback()
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path / "out", max_steps=4),
        train_dataset=token_rows(8),
        callbacks=[callback, poison],
    )
    trainer.train()
    poison.handle.remove()
    stats = tmp_path / "out" / "stats"
    assert_artifact_dir_conforms(stats)
    (event,) = read_events(stats).to_pylist()
    assert (event["kind"], event["signal"], event["forward_index"]) == ("nonfinite", "output", 2)
    assert (event["replay"], event["layer"], event["module_type"]) == (
        "reproduced",
        "transformer.h.1.attn.c_attn",
        "Conv1D",
    )
