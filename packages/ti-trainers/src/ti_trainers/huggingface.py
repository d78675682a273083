"""``HFObserverCallback``: TorchInstruments in a Hugging Face ``transformers.Trainer``.

Needs the ``transformers`` extra: ``pip install "ti-trainers[transformers]"`` (transformers and
accelerate, which the Trainer requires). Lifecycle, owned by the callback: the observer is
attached at ``on_train_begin`` and removed at ``on_train_end`` (artifacts finalized, model
clean). The Trainer gives callbacks no event when training raises: then the observer stays
attached until :meth:`HFObserverCallback.remove` is called (do it in a ``finally``), and if the
process ends first, the parts it published stay readable and are finished with
``ti consolidate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Unpack

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as _import_error:
    raise ImportError(
        "Please install `transformers` to use ti_trainers.huggingface (HFObserverCallback), "
        'you can use the `transformers` optional group — `pip install "ti-trainers[transformers]"`'
    ) from _import_error

from torch import nn

from ti_core.api import ObserverOptions
from ti_trainers.attachment import Attachment

STATS_DIR = "stats"
"""The folder under ``args.output_dir`` that receives the artifacts by default."""
DEFAULT_OUTPUT_DIR = "trainer_output"
"""What ``TrainingArguments(output_dir=None)`` means in recent transformers releases."""


class HFObserverCallback(TrainerCallback):
    """Observe the model of a ``transformers.Trainer`` while it trains.

    ``HFObserverCallback(sampler=EveryNForwardsSampler(10))`` takes the keyword arguments of
    ``ti_core.inject_observer``, with these defaults from the Trainer:

    - ``output_dir``: ``<args.output_dir>/stats``; pass ``output_dir=`` to choose, ``None`` to
      write no directory;
    - ``rank_policy``: ``"rank0"`` or ``"all"`` are decided from ``args.process_index`` and
      ``args.world_size`` (accelerate's view of the job, under ``torchrun`` or
      ``accelerate launch``); a ``RankPolicy`` object is used as given.

    The observed module is the Trainer's model (the one inside any DDP wrapper). Every forward
    is a sample candidate: with ``gradient_accumulation_steps=k`` each micro-batch is one root
    forward (``forward_index`` counts micro-batches, not optimizer steps), and evaluation
    batches during training are recorded as ``mode="eval"`` rows. With
    ``gradient_checkpointing=True`` the recomputation during backward is not a new sample
    (docs/capture.md, "Activation checkpointing"). When training raises, call :meth:`remove`.
    """

    def __init__(self, **options: Unpack[ObserverOptions]) -> None:
        super().__init__()
        self._attachment = Attachment(
            options,
            "HFObserverCallback",
            hint="Does your Trainer call the model it was given?",
        )

    @property
    def output_dir(self) -> Path | None:
        """Where this process writes its artifacts (set at train begin; None on ranks that do
        not observe or without a directory)."""
        return self._attachment.output_dir

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Attach to the Trainer's model: ``args.output_dir``, the process's rank."""
        if model is None:
            raise ValueError(
                "HFObserverCallback: the Trainer passed no model to on_train_begin; this "
                "callback works with transformers.Trainer"
            )
        self._attachment.attach(
            model,
            default_dir=Path(args.output_dir or DEFAULT_OUTPUT_DIR) / STATS_DIR,
            rank=int(args.process_index),
            world_size=int(args.world_size),
        )

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Remove the observer: hooks off, artifacts finalized."""
        self._attachment.detach()

    def remove(self) -> None:
        """Remove the observer now (idempotent): after ``trainer.train()`` raised, in a
        ``finally``. ``on_train_end`` does it when training ends normally."""
        self._attachment.detach()
