"""LightningObserverCallback in real ``lightning.Trainer`` runs on the CPU: one process with
validation and a TensorBoardLogger, a fit that raises, the default flight recorder naming the
module that broke, and DDP with two gloo processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from _trainer_helpers import assert_clean, history, hook_counts
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ti_core import AlwaysSampler
from ti_io import read_events
from ti_schema.testing import assert_artifact_dir_conforms
from ti_trainers import LightningObserverCallback


class Regressor(LightningModule):
    """``net.0`` Linear(4, 8) -> ReLU -> Linear(8, 1); raises at ``fail_at`` training batches."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.fail_at = fail_at
        self.first_outputs: list[tuple[bool, np.ndarray]] = []
        """(training, net.0 output in float64) at every call, the independent reference."""
        self.net[0].register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: object, out: torch.Tensor) -> None:
        self.first_outputs.append((self.training, out.detach().double().numpy()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise RuntimeError("boom inside training_step")
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(batches: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8 * batches, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def trainer(root: Path, **kwargs: object) -> Trainer:
    settings: dict[str, object] = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "logger": TensorBoardLogger(root, name="lt", version=0),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 1,
    }
    settings.update(kwargs)
    return Trainer(**settings)  # type: ignore[arg-type]


def test_a_fit_writes_the_log_dir_records_validation_and_leaves_the_model_clean(
    tmp_path: Path,
) -> None:
    module = Regressor()
    before = hook_counts(module)
    callback = LightningObserverCallback(sampler=AlwaysSampler())
    trainer(tmp_path, callbacks=[callback]).fit(module, loader(4), loader(2))

    stats = tmp_path / "lt" / "version_0" / "stats"
    assert callback.output_dir == stats
    assert_artifact_dir_conforms(stats)
    assert_clean(module, before)

    rows = history(stats).filter(
        (pl.col("layer") == "net.0") & (pl.col("signal") == "output") & (pl.col("metric") == "std")
    )
    # one sanity-check batch, four training batches, two validation batches: every call sampled
    expected_modes = [False, True, True, True, True, False, False]
    assert [training for training, _ in module.first_outputs] == expected_modes
    ordered = rows.sort("forward_index")
    assert ordered.get_column("forward_index").to_list() == list(range(7))
    assert ordered.get_column("mode").to_list() == [
        "train" if training else "eval" for training in expected_modes
    ]
    for value, (_, output) in zip(ordered.get_column("value"), module.first_outputs, strict=True):
        assert value == pytest.approx(np.std(output), rel=1e-6)
    eval_grads = history(stats).filter(
        (pl.col("mode") == "eval") & (pl.col("signal") == "output_gradient")
    )
    assert eval_grads.height == 0  # validation runs without gradients

    # the histograms went into Lightning's own logger directory, next to its scalars
    events = EventAccumulator(str(tmp_path / "lt" / "version_0"), size_guidance={"histograms": 0})
    events.Reload()
    assert any("net.0" in tag for tag in events.Tags()["histograms"])
    assert "val_loss" in events.Tags()["scalars"]


def test_a_fit_that_raises_still_finalizes_and_unhooks(tmp_path: Path) -> None:
    module = Regressor(fail_at=2)
    before = hook_counts(module)
    callback = LightningObserverCallback(sampler=AlwaysSampler(), logger_histograms=False)
    with pytest.raises(RuntimeError, match="boom inside training_step"):
        trainer(tmp_path, callbacks=[callback], num_sanity_val_steps=0).fit(module, loader(4))
    assert_clean(module, before)
    stats = tmp_path / "lt" / "version_0" / "stats"
    assert_artifact_dir_conforms(stats)  # consolidated: not only parts
    rows = history(stats)
    assert sorted(rows.get_column("forward_index").unique().to_list()) == [0, 1]


class ShiftedLog(nn.Module):
    """``log(|x| + shift)``: NaN once ``shift`` is very negative."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.abs() + self.shift)


class BreaksAt(Regressor):
    """``net``: Linear(4, 8) -> ShiftedLog -> Linear(8, 1); training batch ``bad`` breaks."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.net[1] = ShiftedLog()
        self.bad = bad

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.net[1].shift = -100.0 if batch_idx == self.bad else 1.0
        return super().training_step(batch, batch_idx)


def test_the_sentinel_is_on_by_default_and_its_replay_names_the_module(tmp_path: Path) -> None:
    module = BreaksAt(bad=2)
    callback = LightningObserverCallback(logger_histograms=False)
    trainer(tmp_path, callbacks=[callback], num_sanity_val_steps=0).fit(module, loader(4))
    stats = tmp_path / "lt" / "version_0" / "stats"
    assert_artifact_dir_conforms(stats)
    (event,) = read_events(stats).to_pylist()
    assert (event["kind"], event["signal"], event["forward_index"]) == ("nonfinite", "output", 2)
    assert (event["replay"], event["layer"], event["module_type"]) == (
        "reproduced",
        "net.1",
        "ShiftedLog",
    )


def test_module_names_the_submodule_the_steps_call(tmp_path: Path) -> None:
    module = Regressor()
    callback = LightningObserverCallback(
        module="net", output_dir=tmp_path / "own", sampler=AlwaysSampler()
    )
    trainer(tmp_path, callbacks=[callback], logger=False, num_sanity_val_steps=0).fit(
        module, loader(2)
    )
    layers = set(history(tmp_path / "own").get_column("layer").to_list())
    assert "0" in layers  # relative to the observed submodule: net.0 is "0"
    assert "net.0" not in layers
    with pytest.raises(TypeError, match="module="):
        LightningObserverCallback(module="")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        LightningObserverCallback(samplr=AlwaysSampler())  # type: ignore[call-arg]


DDP_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import TensorBoardLogger

    from ti_core import AlwaysSampler, has_observer
    from ti_trainers import LightningObserverCallback
    from test_lightning import Regressor, loader

    root = Path(sys.argv[1])
    for policy in ("rank0", "all"):
        module = Regressor()
        callback = LightningObserverCallback(sampler=AlwaysSampler(), rank_policy=policy)
        trainer = Trainer(
            max_epochs=1, accelerator="cpu", devices=2, strategy="ddp", callbacks=[callback],
            logger=TensorBoardLogger(root, name=policy, version=0),
            enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0,
        )
        trainer.fit(module, loader(4))
        assert not has_observer(module)
        print(f"rank {trainer.global_rank} {policy} {callback.output_dir}", flush=True)
    """
)


def test_ddp_with_two_gloo_processes_uses_the_strategys_rank(tmp_path: Path) -> None:
    """Lightning's own launcher starts the second process (it re-runs this script)."""
    script = tmp_path / "fit_ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK"))}
    tests_dir = str(Path(__file__).parent)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, env.get("PYTHONPATH")])),
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = tmp_path / "logs"
    rank0 = logs / "rank0" / "version_0" / "stats"
    assert_artifact_dir_conforms(rank0)
    assert history(rank0).get_column("rank").unique().to_list() == [0]
    assert not any(rank0.glob("rank-*"))
    assert "rank 1 rank0 None" in done.stdout

    every = logs / "all" / "version_0" / "stats"
    assert_artifact_dir_conforms(every)
    assert sorted(p.name for p in every.glob("rank-*")) == ["rank-000", "rank-001"]
    for rank in (0, 1):
        rows = history(every / f"rank-{rank:03d}")
        assert rows.get_column("rank").unique().to_list() == [rank]
        # each rank sees half of the four batches of its DistributedSampler
        assert sorted(rows.get_column("forward_index").unique().to_list()) == [0, 1]
        assert f"rank {rank} all {every / f'rank-{rank:03d}'}" in done.stdout
