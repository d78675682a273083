"""``LightningObserverCallback``: TorchInstruments in a Lightning ``Trainer`` (``lightning``).

Needs the ``lightning`` extra: ``pip install "ti-trainers[lightning]"``. Lifecycle, owned by the
callback: the observer is attached at ``on_fit_start`` (after the strategy has set the model up,
so the rank is known) and removed at ``on_fit_end``, or at ``on_exception`` when the fit fails;
removal finalizes the artifacts and leaves the model without any hook. ``teardown`` removes it
too, should Lightning skip both. ``loss_trigger=`` reads the training step's loss when Lightning
logs (every ``log_every_n_steps`` optimizer steps) and asks for a dense capture on a non-finite
loss or a spike (:class:`ti_trainers.LossSpike`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Unpack

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.loggers import TensorBoardLogger
except ImportError as _import_error:
    raise ImportError(
        "Please install `lightning` to use ti_trainers.lightning (LightningObserverCallback), "
        'you can use the `lightning` optional group — `pip install "ti-trainers[lightning]"`'
    ) from _import_error

from torch import Tensor, nn

from ti_core.options import ObserverOptions
from ti_core.sink import Sink
from ti_io import TensorBoardSink
from ti_trainers.attachment import Attachment
from ti_trainers.loss_spike import LossSpike

STATS_DIR = "stats"
"""The folder under the trainer's log directory that receives the artifacts by default."""


def _log_every_n_steps(trainer: Trainer) -> int:
    """``Trainer(log_every_n_steps=...)`` (set on the trainer at construction, untyped)."""
    every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]
    return every


class LightningObserverCallback(Callback):
    """Observe a ``LightningModule`` during ``Trainer.fit``.

    ``LightningObserverCallback(sampler=EveryNForwardsSampler(50), rank_policy="all")`` takes the
    keyword arguments of ``ti_core.inject_observer``, with these defaults from the trainer:

    - ``output_dir``: ``<trainer.log_dir>/stats`` (the logger's version folder, else
      ``default_root_dir``); pass ``output_dir=`` to choose, ``None`` to write no directory;
    - ``rank_policy``: ``"rank0"`` or ``"all"`` are decided from the strategy's
      ``global_rank`` and ``world_size`` (``ti_trainers.TrainerRanks``); a ``RankPolicy``
      object is used as given;
    - ``sink``: when the trainer has a ``TensorBoardLogger``, rank 0 also writes the focus
      layers' histograms into it (ti-io's ``TensorBoardSink``, next to the logger's scalars);
      ``logger_histograms=False`` turns that off. Your own ``sink=`` is kept.

    ``module``: the submodule to observe, as a dotted attribute path (``"model"`` for
    ``self.model``), when the steps call it rather than the LightningModule itself; default the
    LightningModule. The sampling unit is a call of the observed module (a root forward):
    validation batches are recorded too, as ``mode="eval"`` rows without gradients (the sanity
    check's batches included). Each ``fit`` writes a new run; artifacts of a failed fit are
    finalized all the same.

    ``loss_trigger``: ``True`` (``LossSpike()``: z=4, window=50, min_history=10), a
    :class:`ti_trainers.LossSpike`, or None (default, off). The loss is the one Lightning passes
    to ``on_train_batch_end`` (the ``training_step`` tensor, or its ``"loss"`` entry; divided
    by ``accumulate_grad_batches``, as Lightning scales it), read on the host only on the
    batches where Lightning logs: the optimizer stepped and ``global_step`` is a multiple of
    ``log_every_n_steps`` (set ``Trainer(log_every_n_steps=1)`` to test every step). A
    non-finite loss or a spike records a ``loss`` event and samples the next root forwards in
    full (``ti_core.trigger_capture``; ``sentinel=Sentinel(dense_forwards=...)`` sets how many,
    default 4).
    """

    def __init__(
        self,
        *,
        module: str | None = None,
        logger_histograms: bool = True,
        loss_trigger: bool | LossSpike | None = None,
        **options: Unpack[ObserverOptions],
    ) -> None:
        super().__init__()
        if module is not None and (not isinstance(module, str) or not module):
            raise TypeError(
                "LightningObserverCallback(module=...) is the dotted attribute path of a "
                f"submodule (e.g. 'model' for self.model), or None; got {module!r}"
            )
        if not isinstance(logger_histograms, bool):
            raise TypeError(
                f"LightningObserverCallback(logger_histograms=...) must be a bool, got "
                f"{logger_histograms!r}"
            )
        self._module = module
        self._logger_histograms = logger_histograms
        self._attachment = Attachment(
            options,
            "LightningObserverCallback",
            hint=(
                "Call it in your steps (`self(x)` in training_step and validation_step), or "
                "pass module='...' naming the submodule they call"
            ),
            loss_trigger=loss_trigger,
        )
        self._step_before_batch: int | None = None
        self._loss_warned = False

    @property
    def output_dir(self) -> Path | str | None:
        """Where this process writes its artifacts: a ``Path``, or the URI on an object store
        (set at fit start; None on ranks that do not observe or without a directory)."""
        return self._attachment.output_dir

    def observed_module(self, pl_module: LightningModule) -> nn.Module:
        """The module the observer is attached to: ``pl_module`` or its ``module`` path."""
        if self._module is None:
            return pl_module
        try:
            return pl_module.get_submodule(self._module)
        except AttributeError as exc:
            raise AttributeError(
                f"LightningObserverCallback(module={self._module!r}): {type(pl_module).__name__} "
                f"has no such submodule ({exc}); name an attribute path of "
                f"{type(pl_module).__name__}.named_modules()"
            ) from exc

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Attach: the trainer's log directory, the strategy's rank, the TensorBoard logger."""
        # Every rank must ask: Lightning broadcasts rank 0's log directory to all of them.
        log_dir = trainer.log_dir or trainer.default_root_dir
        sinks: list[Sink] = []
        if self._logger_histograms and trainer.global_rank == 0:
            logger = next((x for x in trainer.loggers if isinstance(x, TensorBoardLogger)), None)
            if logger is not None:
                sinks.append(TensorBoardSink(logger))
        self._attachment.attach(
            self.observed_module(pl_module),
            default_dir=Path(log_dir) / STATS_DIR,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            extra_sinks=sinks,
        )
        self._step_before_batch = None
        self._loss_warned = False
        if self.loss_trigger is not None and _log_every_n_steps(trainer) <= 0:
            self._warn_once(
                "Trainer(log_every_n_steps=0) logs no training step, so loss_trigger reads no "
                "loss; set log_every_n_steps >= 1"
            )

    @property
    def loss_trigger(self) -> LossSpike | None:
        """The loss test (``loss_trigger=``), or None when off."""
        return self._attachment.loss_spike

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Remember the optimizer step count, to tell at batch end whether the optimizer
        stepped (not on an accumulation micro-batch)."""
        self._step_before_batch = trainer.global_step

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """On a batch Lightning logs, test the step's loss (``loss_trigger=``)."""
        if self.loss_trigger is None or not self._attachment.attached:
            return
        step, every = trainer.global_step, _log_every_n_steps(trainer)
        stepped = self._step_before_batch is not None and step != self._step_before_batch
        self._step_before_batch = None
        if not stepped or every <= 0 or step % every:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, Tensor) and loss.numel() == 1:
            value = float(loss.detach())  # the host read, at the logging cadence only
        elif isinstance(loss, int | float) and not isinstance(loss, bool):
            value = float(loss)
        else:
            if loss is not None:  # None: a skipped step, nothing to test
                self._warn_once(
                    "training_step returned no scalar loss (a one-element tensor, or a dict "
                    f"with one under 'loss'), got {type(loss).__name__}: loss_trigger skips it"
                )
            return
        self._attachment.report_loss(value)

    def _warn_once(self, message: str) -> None:
        if not self._loss_warned:
            self._loss_warned = True
            warnings.warn(f"LightningObserverCallback: {message}", UserWarning, stacklevel=3)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Remove the observer: hooks off, artifacts finalized."""
        self._attachment.detach()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        """The fit failed: remove the observer all the same (before Lightning closes the
        loggers), so the artifacts are finalized and the model is left clean."""
        self._attachment.detach()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove the observer if it is still attached (a no-op after on_fit_end)."""
        self._attachment.detach()

    def remove(self) -> None:
        """Remove the observer now (idempotent); the trainer's events call this already."""
        self._attachment.detach()

    def state_dict(self) -> dict[str, Any]:
        """Nothing to checkpoint: every fit starts a new run."""
        return {}
