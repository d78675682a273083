"""A Hugging Face ``transformers.Trainer`` run from a config, observed by ti-trainers' callback.

The tiny GPT-2 of :mod:`ti_examples.transformer_tiny` (built from ``GPT2Config``, nothing
downloaded) learns the same counting task, but trained by ``transformers.Trainer`` with
``HFObserverCallback`` in its callbacks: the observer is attached when training begins and
removed when it ends, and writes to ``<args.output_dir>/stats``. Two micro-batches are
accumulated per optimizer step, so ``forward_index`` counts micro-batches.

Requires the ``transformers`` extra (``pip install "ti-examples[transformers]"``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ti_core import EveryNForwardsSampler
from ti_examples.transformer_tiny import build_model, counting_batches


@dataclass(frozen=True)
class HFTrainerResult:
    """Where the run wrote its artifacts and how its training loss moved."""

    stats_dir: Path
    first_loss: float
    last_loss: float


def run_hf_trainer_tiny(
    output_dir: Path,
    *,
    steps: int = 12,
    batch_size: int = 8,
    accumulation: int = 2,
    seed: int = 0,
    sample_every: int = 3,
) -> HFTrainerResult:
    """Train ``steps`` optimizer steps with ``transformers.Trainer`` under the callback."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Trainer, TrainingArguments

    from ti_trainers import HFObserverCallback

    batches = counting_batches(steps * accumulation, batch_size, seed)
    rows = [{"input_ids": ids, "labels": ids} for batch in batches for ids in batch]
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
    )
    callback = HFObserverCallback(sampler=EveryNForwardsSampler(sample_every))
    trainer = Trainer(model=build_model(seed), args=args, train_dataset=rows, callbacks=[callback])
    try:
        trainer.train()
    finally:
        callback.remove()  # a no-op after a normal end; the Trainer has no exception event
    losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    assert isinstance(callback.output_dir, Path)  # a local run: its Path
    return HFTrainerResult(
        stats_dir=callback.output_dir, first_loss=losses[0], last_loss=losses[-1]
    )


__all__ = ["HFTrainerResult", "run_hf_trainer_tiny"]
