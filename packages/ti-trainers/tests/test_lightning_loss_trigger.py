"""``LightningObserverCallback(loss_trigger=...)`` in real ``lightning.Trainer`` fits on the CPU:
a loss that spikes and one that turns NaN at chosen batches record ``loss`` events with the
loss and the dense rows after them; the loss is read only on the batches Lightning logs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _trainer_helpers import history
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ti_core import EveryNForwardsSampler, MemorySink, Sentinel
from ti_io import read_events
from ti_schema.testing import assert_artifact_dir_conforms
from ti_trainers import LightningObserverCallback, LossSpike


class Spiky(LightningModule):
    """A regressor whose loss value is multiplied by ``factors[batch_idx]`` (NaN allowed) while
    its gradient stays the real one, so training itself is not disturbed."""

    def __init__(self, factors: dict[int, float], *, as_dict: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.factors = factors
        self.as_dict = as_dict
        self.losses: list[float] = []
        """The training_step loss of every batch, as returned (the reference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(
        self, batch: list[torch.Tensor], batch_idx: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        factor = self.factors.get(batch_idx)
        if factor is not None:
            loss = loss + (factor - 1.0) * loss.detach()
        self.losses.append(float(loss.detach()))
        return {"loss": loss} if self.as_dict else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(batches: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8 * batches, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def fit(root: Path, module: Spiky, callback: LightningObserverCallback, **kwargs: object) -> Path:
    settings: dict[str, object] = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "default_root_dir": str(root),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
    }
    settings.update(kwargs)
    Trainer(callbacks=[callback], **settings).fit(module, loader(20))  # type: ignore[arg-type]
    stats = root / "stats"
    assert callback.output_dir == stats
    assert_artifact_dir_conforms(stats)
    return stats


def spike_reason(window: list[float], loss: float, z: float) -> str:
    values = np.asarray(window, dtype=np.float64)
    mean, sd = float(np.mean(values)), float(np.std(values))
    assert loss > mean + z * sd
    return f"loss {loss:.6g} > mean {mean:.6g} + {z:g} sd ({sd:.6g}) of the last {len(window)}"


def test_a_spike_and_a_nan_loss_each_record_a_loss_event_and_a_dense_capture(
    tmp_path: Path,
) -> None:
    module = Spiky({12: 50.0, 16: math.nan})
    callback = LightningObserverCallback(
        sampler=EveryNForwardsSampler(1000),  # forward 0 only: the rest are the captures
        sentinel=Sentinel(dense_forwards=3),  # passed to inject_observer: 3 dense forwards
        loss_trigger=True,
        logger_histograms=False,
    )
    stats = fit(tmp_path, module, callback)
    assert len(module.losses) == 20

    spike, nan = read_events(stats).to_pylist()
    # the outputs' loss, read after the optimizer step of each logged batch (every batch here)
    assert spike["kind"] == "loss"
    assert spike["value"] == module.losses[12]
    assert spike["reason"] == spike_reason(module.losses[:12], module.losses[12], 4.0)
    assert spike["forward_index"] == 12
    assert (spike["dense_first_forward"], spike["dense_forwards"]) == (13, 3)
    assert nan["kind"] == "loss"
    assert math.isnan(nan["value"])
    assert nan["reason"] == "loss nan is not finite"
    assert nan["forward_index"] == 16
    assert (nan["dense_first_forward"], nan["dense_forwards"]) == (17, 3)
    # the model's outputs stayed finite: the sentinel recorded nothing of its own
    assert {spike["signal"], nan["signal"]} == {None}

    forwards = sorted(history(stats).get_column("forward_index").unique().to_list())
    assert forwards == [0, 13, 14, 15, 17, 18, 19]


def test_the_loss_is_read_only_on_the_batches_lightning_logs(tmp_path: Path) -> None:
    """accumulate_grad_batches=2, log_every_n_steps=2: the optimizer steps after odd batches
    and Lightning logs at even global steps, i.e. after batches 3, 7, 11, 15, 19. The spike at
    batch 13 is never read; the loss read is the one Lightning hands over, divided by 2."""
    module = Spiky({11: 50.0, 13: 50.0, 15: math.nan}, as_dict=True)
    callback = LightningObserverCallback(
        sampler=EveryNForwardsSampler(1000),
        loss_trigger=LossSpike(window=5, min_history=2),
        logger_histograms=False,
    )
    stats = fit(tmp_path, module, callback, accumulate_grad_batches=2, log_every_n_steps=2)
    assert callback.loss_trigger is not None
    read = [module.losses[b] / 2 for b in (3, 7, 11, 19)]  # the finite ones read
    assert callback.loss_trigger.history == pytest.approx(read, rel=1e-7)

    spike, nan = read_events(stats).to_pylist()
    assert spike["value"] == pytest.approx(module.losses[11] / 2, rel=1e-7)
    window = [module.losses[3] / 2, module.losses[7] / 2]
    assert spike["reason"] == spike_reason(window, spike["value"], 4.0)
    assert (spike["forward_index"], spike["dense_first_forward"]) == (11, 12)
    assert math.isnan(nan["value"])
    assert (nan["forward_index"], nan["dense_first_forward"]) == (15, 16)
    assert nan["dense_forwards"] == 4  # the default sentinel's (and trigger_capture's) 4
    forwards = sorted(history(stats).get_column("forward_index").unique().to_list())
    assert forwards == [0, *range(12, 20)]


def test_without_loss_trigger_nothing_is_read_and_log_every_0_warns(tmp_path: Path) -> None:
    sink = MemorySink()
    callback = LightningObserverCallback(
        sampler=EveryNForwardsSampler(1000), sink=sink, output_dir=None
    )
    assert callback.loss_trigger is None
    fit_dir = tmp_path / "off"
    Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        default_root_dir=str(fit_dir),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[callback],
    ).fit(Spiky({5: math.nan}), loader(8))
    assert sink.events().num_rows == 0  # off by default
    assert sink.table().num_rows > 0  # observed all the same

    callback = LightningObserverCallback(loss_trigger=True, logger_histograms=False)
    with pytest.warns(UserWarning, match="log_every_n_steps=0"):
        fit(tmp_path / "zero", Spiky({5: math.nan}), callback, log_every_n_steps=0)
    assert read_events(tmp_path / "zero" / "stats").num_rows == 0
    with pytest.raises(TypeError, match=r"loss_trigger=\.\.\."):
        LightningObserverCallback(loss_trigger="on")  # type: ignore[arg-type]
