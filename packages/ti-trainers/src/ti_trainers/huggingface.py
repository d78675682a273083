"""``HFObserverCallback``: TorchInstruments in a Hugging Face ``transformers.Trainer``.

Needs the ``transformers`` extra: ``pip install "ti-trainers[transformers]"`` (transformers and
accelerate, which the Trainer requires). Lifecycle, owned by the callback: the observer is
attached at ``on_train_begin`` and removed at ``on_train_end`` (artifacts finalized, model
clean). The Trainer gives callbacks no event when training raises: then the observer stays
attached until :meth:`HFObserverCallback.remove` is called (do it in a ``finally``), and if the
process ends first, the parts it published stay readable and are finished with
``ti consolidate``. ``loss_trigger=`` tests the training loss of every log (``on_log``) and
asks for a dense capture on a non-finite loss or a spike (:class:`ti_trainers.LossSpike`).
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

from ti_core.options import ObserverOptions
from ti_trainers.attachment import Attachment
from ti_trainers.loss_spike import LossSpike

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

    ``loss_trigger``: ``True`` (``LossSpike()``: z=4, window=50, min_history=10), a
    :class:`ti_trainers.LossSpike`, or None (default, off). The loss is ``logs["loss"]`` of
    each training log (every ``logging_steps``: the mean loss since the previous log, already
    a float, so no device read is added). A non-finite loss or a spike records a ``loss``
    event and samples the next root forwards in full (``ti_core.trigger_capture``;
    ``sentinel=Sentinel(dense_forwards=...)`` sets how many, default 4). The Trainer replaces a
    non-finite step loss by the running mean unless ``logging_nan_inf_filter=False``: set it
    for the non-finite test to see NaN losses (or use ``sentinel=True``, which checks the
    model's outputs and gradients).
    """

    def __init__(
        self,
        *,
        loss_trigger: bool | LossSpike | None = None,
        **options: Unpack[ObserverOptions],
    ) -> None:
        super().__init__()
        self._attachment = Attachment(
            options,
            "HFObserverCallback",
            hint="Does your Trainer call the model it was given?",
            loss_trigger=loss_trigger,
        )

    @property
    def loss_trigger(self) -> LossSpike | None:
        """The loss test (``loss_trigger=``), or None when off."""
        return self._attachment.loss_spike

    @property
    def output_dir(self) -> Path | str | None:
        """Where this process writes its artifacts: a ``Path``, or the URI on an object store
        (set at train begin; None on ranks that do not observe or without a directory)."""
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

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Test the training loss of this log (``loss_trigger=``); evaluation logs and the
        final summary (``eval_loss``, ``train_loss``) are not training losses."""
        loss = (logs or {}).get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            self._attachment.report_loss(float(loss))

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
