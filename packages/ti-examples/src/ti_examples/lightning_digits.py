"""A real trainer on real data: Lightning on scikit-learn's bundled handwritten digits.

The digits (1,797 8x8 images, shipped inside scikit-learn, no download) are split 75/25 into
train and test sets. A small MLP trains with Lightning on the CPU under ti-trainers'
``LightningObserverCallback``, which writes the directory artifacts and adds the histograms to
Lightning's own ``TensorBoardLogger``. The logger stays Lightning's: the observer never closes it.

Requires the ``lightning`` extra (``pip install "ti-examples[lightning]"``).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ti_core import EveryNForwardsSampler, inject_observer, remove_observer
from ti_io import TensorBoardSink
from ti_trainers import LightningObserverCallback

STATED_TEST_ACCURACY = 0.978
"""Test accuracy measured with the defaults (seed 0, 10 epochs, CPU); see examples/README.md."""


class DigitsClassifier(LightningModule):
    """``net.0`` Linear(64, 128) -> ``net.1`` ReLU -> ``net.2`` Linear(128, 10)."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    # Steps call self(x) so every batch is one root forward of the observed module.
    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        accuracy = (self(x).argmax(dim=1) == y).float().mean()
        self.log("val_accuracy", accuracy, on_epoch=True, batch_size=len(y))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        accuracy = (self(x).argmax(dim=1) == y).float().mean()
        self.log("test_accuracy", accuracy, on_epoch=True, batch_size=len(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


@dataclass(frozen=True)
class DigitsResult:
    """Where the run wrote its artifacts and what it reached."""

    stats_dir: Path
    """The directory artifacts (history.parquet, result.json, index.md, tensorboard/)."""
    logger_dir: Path
    """Lightning's TensorBoardLogger directory, holding its scalars and our histograms."""
    test_accuracy: float
    train_size: int
    test_size: int
    epochs: int


def digits_loaders(
    seed: int, batch_size: int
) -> tuple[DataLoader[tuple[torch.Tensor, ...]], DataLoader[tuple[torch.Tensor, ...]]]:
    """Stratified 75/25 train/test split of the digits, pixels scaled to [0, 1]."""
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images / 16.0, labels, test_size=0.25, random_state=seed, stratify=labels
    )

    def dataset(x: object, y: object) -> TensorDataset:
        return TensorDataset(
            torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long)
        )

    generator = torch.Generator().manual_seed(seed)
    train = DataLoader(
        dataset(x_train, y_train), batch_size=batch_size, shuffle=True, generator=generator
    )
    test = DataLoader(dataset(x_test, y_test), batch_size=256)
    return train, test


def run_lightning_digits(
    output_dir: Path,
    *,
    epochs: int = 10,
    batch_size: int = 64,
    seed: int = 0,
    sample_every: int = 10,
    progress_bar: bool = False,
    default_stats_dir: bool = False,
) -> DigitsResult:
    """Train the classifier under the observer, then test it; returns the test accuracy.

    Writes ``output_dir/stats`` (directory artifacts) and ``output_dir/lightning`` (Lightning's
    logger). ``LightningObserverCallback`` observes ``fit``, whose validation loop runs the
    test split, so the history holds ``eval`` rows. ``default_stats_dir=True`` attaches as
    torchinstruments 0.8.0's Lightning example did instead, ``inject_observer(model,
    sink=TensorBoardSink(logger))`` without ``output_dir=`` around ``fit`` and ``test``:
    ``sink=`` adds to the default directory, so the artifacts go to ``stats`` in the working
    directory.
    """
    output_dir = Path(output_dir)
    seed_everything(seed, verbose=False)
    train, test = digits_loaders(seed, batch_size)
    model = DigitsClassifier()
    logger = TensorBoardLogger(save_dir=output_dir, name="lightning", version=0)
    sampler = EveryNForwardsSampler(sample_every)
    callbacks: list[Callback] = []
    if default_stats_dir:
        stats_dir = Path.cwd() / "stats"
        inject_observer(model, sink=TensorBoardSink(logger), sampler=sampler)
    else:
        stats_dir = output_dir / "stats"
        callbacks.append(LightningObserverCallback(output_dir=stats_dir, sampler=sampler))
    try:
        with _quiet_lightning():
            trainer = Trainer(
                max_epochs=epochs,
                accelerator="cpu",
                devices=1,
                logger=logger,
                callbacks=callbacks,
                enable_checkpointing=False,
                enable_progress_bar=progress_bar,
                enable_model_summary=False,
                deterministic=True,
                log_every_n_steps=10,
                num_sanity_val_steps=0,
            )
            validation = None if default_stats_dir else test
            trainer.fit(model, train_dataloaders=train, val_dataloaders=validation)
            (metrics,) = trainer.test(model, dataloaders=test, verbose=False)
    finally:
        if default_stats_dir:
            remove_observer(model)
    logger.finalize("success")
    return DigitsResult(
        stats_dir=stats_dir,
        logger_dir=Path(logger.log_dir),
        test_accuracy=float(metrics["test_accuracy"]),
        train_size=len(train.dataset),  # type: ignore[arg-type]
        test_size=len(test.dataset),  # type: ignore[arg-type]
        epochs=epochs,
    )


class _quiet_lightning:  # noqa: N801 - used like a function
    """Silence Lightning's CPU-only hints (worker counts, GPU availability) during a run."""

    def __enter__(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        self._logger = logging.getLogger("lightning.pytorch")
        self._level = self._logger.level
        self._logger.setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)
        self._warnings.__exit__(*exc)  # type: ignore[arg-type]
