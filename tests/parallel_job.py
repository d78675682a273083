"""Tensor, sequence, 2D (FSDP2 x tensor) and pipeline parallel jobs observed on every rank.

``python parallel_job.py SETTINGS_JSON`` imports torch and ti-core once, then forks
``world`` processes (gloo on CPU). Each phase trains a fresh model (``torch.manual_seed(0)``:
the same initial weights on every rank) for ``steps`` steps, observed with
``rank_policy="all"`` into ``phase["out"]``, with outputs of every parallelized module left as
DTensors (``use_local_output=False``). Phases (``phase["kind"]``):

- ``tp`` (2 ranks): ``mlp = Sequential(Linear(8, 16), ReLU(), Linear(16, 8))``, layer 0
  column-wise, layer 2 row-wise (output replicated), and beside it ``partial``, a ``Partial``
  DTensor whose sum over the ranks is the MLP's output (in the loss with weight 0). Every rank
  trains on the same batches; ``AlwaysSampler``.
- ``sp`` (2 ranks): a block ``norm -> up -> act -> down`` with ``SequenceParallel`` on the
  norm, ``up`` column-wise from a sequence-sharded input, ``down`` row-wise back to
  sequence-sharded; each rank holds its half of the sequence. The default timed sampler
  (aligned across the ranks).
- ``2d`` (4 ranks): a 2 x 2 mesh ``("dp", "tp")``: the ``tp`` MLP's layers tensor-parallel on
  ``mesh["tp"]``, sharded with ``fully_shard`` on ``mesh["dp"]``; the two data-parallel groups
  train on different batches. The default timed sampler.

- ``gpipe`` / ``1f1b`` (2 ranks): ``pipeline_model()`` split in two stages (rank 0 keeps
  layers 0-2, rank 1 layers 3-5, the model's own names), run by ``ScheduleGPipe`` /
  ``Schedule1F1B`` with ``microbatches`` microbatches of 2 rows, each stage observed with
  ``inject_stage_observer`` and ``AlwaysSampler``. ``poison_step``: from that step on, the
  last layer takes the log of negative numbers (real NaNs, made on rank 1);
  ``declared_microbatches``: the count given to ``inject_stage_observer`` instead of the
  schedule's (a mistake the observer warns of). Side files:
  ``<phase>-x.npy`` / ``<phase>-y.npy`` (step 0's batch and target).

Each rank saves, under ``side/``: ``<phase>-weights.npz`` (rank 0: the initial full weights,
float64), ``<phase>-rank<r>-x.npy`` (the full batch of forward 0, float64) and
``<phase>-rank<r>.json``: the collectives this process issued in the ``steps`` observed steps
and in as many steps after the observer was removed (``torch.profiler`` events of the process
group: ``c10d::`` and ``gloo:``), and the TelemetryWarnings it saw.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ti_core import AlwaysSampler, TelemetryWarning, inject_observer, remove_observer


class Halves(nn.Module):
    """A ``Partial`` DTensor whose sum over the ranks is the (replicated) input."""

    def forward(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor, Partial

        world = x.device_mesh.size()
        return DTensor.from_local(x.to_local() / world, x.device_mesh, [Partial()])


class WithPartial(nn.Module):
    """The MLP, and beside it ``Halves`` of its output: a ``Partial`` DTensor that reaches the
    loss only with weight 0 (its gradient arrives replicated, unlike the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.partial = Halves()

    def forward(self, x: torch.Tensor) -> tuple[Any, Any]:
        out = self.mlp(x)
        return out, self.partial(out)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> Any:
        return self.down(self.act(self.up(self.norm(x))))


class ShiftedLog(nn.Module):
    """``log(x + shift)``: finite while ``shift`` (a buffer, 10) keeps the argument positive;
    a job sets it to -10 to make real NaNs from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.tensor(10.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + self.shift)


def pipeline_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4), ShiftedLog()
    )


def run_pipeline(rank: int, world: int, side: Path, phase: dict[str, Any]) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ti_core import inject_stage_observer, remove_stage_observer

    name = phase["name"]
    torch.manual_seed(0)
    model = pipeline_model()
    _save_weights(side, name, model, rank)
    # each rank keeps its part of the model: the model's own names ("0".."2" and "3".."5")
    part = model[:3] if rank == 0 else model[3:]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule_type = Schedule1F1B if phase["kind"] == "1f1b" else ScheduleGPipe
    microbatches = phase["microbatches"]
    schedule = schedule_type(
        stage, n_microbatches=microbatches, loss_fn=torch.nn.functional.mse_loss
    )
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TelemetryWarning)
        inject_stage_observer(
            stage,
            microbatches=phase.get("declared_microbatches", microbatches),
            output_dir=phase["out"],
            rank_policy="all",
            sampler=AlwaysSampler(),
        )
        for step in range(phase["steps"]):
            x = torch.randn(2 * microbatches, 8, generator=data)
            y = torch.randn(2 * microbatches, 4, generator=data)
            if step == 0:
                np.save(side / f"{name}-x.npy", x.double().numpy())
                np.save(side / f"{name}-y.npy", y.double().numpy())
            if step == phase.get("poison_step") and rank == world - 1:
                with torch.no_grad():
                    model[5].shift.fill_(-10.0)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            opt.step()
            opt.zero_grad()
        remove_stage_observer(stage)
    record = {
        "warnings": [str(w.message) for w in caught if issubclass(w.category, TelemetryWarning)]
    }
    (side / f"{name}-rank{rank}.json").write_text(json.dumps(record))


def _collectives(step: Any) -> dict[str, int]:
    """The process-group operations this process issues during ``step()``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = (e.name for e in prof.events())
    return dict(collections.Counter(n for n in names if n.startswith(("c10d::", "gloo:"))))


def _save_weights(side: Path, name: str, model: nn.Module, rank: int) -> None:
    if rank == 0:
        state = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
        np.savez(side / f"{name}-weights.npz", **state)


def run_phase(rank: int, world: int, side: Path, phase: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    name, kind = phase["name"], phase["kind"]
    torch.manual_seed(0)
    options: dict[str, Any] = {}
    if kind == "sp":
        model: nn.Module = Block()
        _save_weights(side, name, model, rank)
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(
            model,
            mesh,
            {
                "norm": SequenceParallel(use_local_output=False),
                "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
                "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            },
        )
        options["interval"] = phase["interval"]
        data = torch.Generator().manual_seed(100)
        shape = (2, 8, 16)
    else:
        model = WithPartial() if kind == "tp" else nn.Sequential(*WithPartial().mlp)
        _save_weights(side, name, model, rank)
        prefix = "mlp." if kind == "tp" else ""
        plan = {
            f"{prefix}0": ColwiseParallel(use_local_output=False),
            f"{prefix}2": RowwiseParallel(output_layouts=Replicate(), use_local_output=False),
        }
        if kind == "tp":
            parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
            options["sampler"] = AlwaysSampler()
            data = torch.Generator().manual_seed(100)
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], plan)
            for layer in (model[0], model[2], model):
                fully_shard(layer, mesh=mesh["dp"])
            options["interval"] = phase["interval"]
            data = torch.Generator().manual_seed(100 + mesh.get_coordinate()[0])
        shape = (4, 8)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(index: int) -> None:
        full = torch.randn(*shape, generator=data)
        if index == 0:
            np.save(side / f"{name}-rank{rank}-x.npy", full.double().numpy())
        x = full.chunk(world, dim=1)[rank] if kind == "sp" else full
        if kind == "tp":
            out, partial = model(x)
            loss = out.full_tensor().pow(2).mean() + 0.0 * partial.full_tensor().sum()
        else:
            loss = model(x).to_local().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TelemetryWarning)
        inject_observer(model, output_dir=phase["out"], rank_policy="all", **options)
        steps = phase["steps"]
        observed = _collectives(lambda: [step(i) for i in range(steps)])
        remove_observer(model)
        bare = _collectives(lambda: [step(i) for i in range(steps, 2 * steps)])
    record = {
        "observed": observed,
        "bare": bare,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, TelemetryWarning)],
    }
    (side / f"{name}-rank{rank}.json").write_text(json.dumps(record))


def worker(rank: int, cfg: dict[str, Any]) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world"],
    )
    for phase in cfg["phases"]:
        if phase["kind"] in ("gpipe", "1f1b"):
            run_pipeline(rank, cfg["world"], Path(cfg["side"]), phase)
        else:
            run_phase(rank, cfg["world"], Path(cfg["side"]), phase)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    import torch.distributed.tensor  # once here rather than in every rank

    mp.start_processes(worker, args=(settings,), nprocs=settings["world"], start_method="fork")
    sys.stdout.flush()
    os._exit(0)
