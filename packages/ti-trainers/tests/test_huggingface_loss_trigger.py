"""``HFObserverCallback(loss_trigger=...)`` in a real ``transformers.Trainer`` on the CPU, on a
tiny torch module: a loss that spikes and one that turns NaN at chosen steps record ``loss``
events with the logged loss and the dense rows after them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _trainer_helpers import history
from torch import nn
from transformers import Trainer, TrainingArguments

from ti_core import EveryNForwardsSampler
from ti_io import read_events
from ti_schema.testing import assert_artifact_dir_conforms
from ti_trainers import HFObserverCallback, LossSpike


class SpikyRegressor(nn.Module):
    """Linear(4, 8) -> ReLU -> Linear(8, 1) with an MSE loss whose value is multiplied by
    ``factors[call]`` (NaN allowed) on training calls, its gradient left the real one."""

    def __init__(self, factors: dict[int, float]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.factors = factors
        self.calls = 0
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        loss = nn.functional.mse_loss(out, labels)
        if self.training:
            factor = self.factors.get(self.calls)
            if factor is not None:
                loss = loss + (factor - 1.0) * loss.detach()
            self.calls += 1
            self.losses.append(float(loss.detach()))
        return {"loss": loss, "logits": out}


def rows(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(count, 4, generator=generator)
    return [{"x": x[i], "labels": x[i].sum().reshape(1)} for i in range(count)]


def train(output_dir: Path, model: nn.Module, callback: HFObserverCallback, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "max_steps": 24,
        "learning_rate": 1e-2,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "steps",
        "logging_steps": 1,
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    settings.update(kwargs)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**settings),
        train_dataset=rows(96),
        callbacks=[callback],
    )
    trainer.train()
    return trainer.state


def spike_reason(window: list[float], loss: float, z: float) -> str:
    values = np.asarray(window, dtype=np.float64)
    mean, sd = float(np.mean(values)), float(np.std(values))
    assert loss > mean + z * sd
    return f"loss {loss:.6g} > mean {mean:.6g} + {z:g} sd ({sd:.6g}) of the last {len(window)}"


@pytest.mark.parametrize("nan_filter", [False, True])
def test_a_spike_and_a_nan_loss_record_loss_events_and_dense_captures(
    tmp_path: Path, nan_filter: bool
) -> None:
    """Step 12's loss spikes, step 18's is NaN. With ``logging_nan_inf_filter=False`` the log
    says NaN and the non-finite test fires; with the Trainer's default filter the log holds the
    running mean instead and only the spike is seen."""
    model = SpikyRegressor({12: 50.0, 18: math.nan})
    # the loss trigger alone: the sentinel (on by default) would see the NaN output too
    callback = HFObserverCallback(
        sampler=EveryNForwardsSampler(1000), loss_trigger=True, sentinel=False
    )
    state = train(tmp_path / "out", model, callback, logging_nan_inf_filter=nan_filter)
    stats = tmp_path / "out" / "stats"
    assert callback.output_dir == stats
    assert_artifact_dir_conforms(stats)

    logged = {entry["step"]: entry["loss"] for entry in state.log_history if "loss" in entry}
    assert sorted(logged) == list(range(1, 25))  # logging_steps=1: step k logs call k - 1
    # (transformers releases before 5 round the logged loss to 4 decimals)
    assert logged[13] == pytest.approx(model.losses[12], rel=1e-6, abs=5e-5)
    events = read_events(stats).to_pylist()
    spike = events[0]
    assert spike["kind"] == "loss"
    assert spike["value"] == logged[13]
    assert spike["reason"] == spike_reason([logged[s] for s in range(1, 13)], logged[13], 4.0)
    assert spike["forward_index"] == 12
    assert (spike["dense_first_forward"], spike["dense_forwards"]) == (13, 4)
    forwards = sorted(history(stats).get_column("forward_index").unique().to_list())
    if nan_filter:
        assert len(events) == 1
        assert math.isfinite(logged[19])
        assert forwards == [0, 13, 14, 15, 16]
        return
    assert len(events) == 2  # the Trainer's loss stays NaN after step 18: one event
    nan = events[1]
    assert math.isnan(logged[19])
    assert (nan["kind"], nan["reason"]) == ("loss", "loss nan is not finite")
    assert math.isnan(nan["value"])
    assert (nan["forward_index"], nan["dense_first_forward"]) == (18, 19)
    assert forwards == [0, 13, 14, 15, 16, 19, 20, 21, 22]


def test_evaluation_logs_are_not_training_losses(tmp_path: Path) -> None:
    """``eval_loss`` (and the final ``train_loss`` summary) are not tested: a NaN evaluation
    loss records nothing."""
    model = SpikyRegressor({})
    detector = LossSpike(window=4, min_history=2)
    callback = HFObserverCallback(
        output_dir=tmp_path / "stats", loss_trigger=detector, sentinel=False
    )
    assert callback.loss_trigger is detector
    nan_rows = [{"x": torch.full((4,), math.nan), "labels": torch.zeros(1)}] * 4
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=3,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows(12),
        eval_dataset=nan_rows,
        callbacks=[callback],
    )
    trainer.train()
    assert any(math.isnan(e.get("eval_loss", 0.0)) for e in trainer.state.log_history)
    assert read_events(tmp_path / "stats").num_rows == 0
    assert len(detector.history) == 3  # the three training logs
    with pytest.raises(TypeError, match=r"loss_trigger=\.\.\."):
        HFObserverCallback(loss_trigger=1)  # type: ignore[arg-type]
