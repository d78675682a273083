"""A data-parallel job with the parameter signal on every rank, for replica drift.

``python drift_job.py SETTINGS_JSON`` imports torch and ti-core once, then forks ``world``
processes (``torch.multiprocessing``, gloo on CPU). Each phase trains a fresh small model under
DDP for ``steps`` steps, every rank on its own data shard, observed with ``rank_policy="all"``,
the parameter signal on and the sampler the settings name (``sampler``: ``"every:N"``,
``"always"`` or ``"timed:SECONDS"``). A phase with ``perturb_rank`` adds ``perturb_by`` to
``0.weight[0, 0]`` on that rank just before forward ``perturb_before`` (after the optimizer step
of the forward before it), so that rank's replica forks from then on. The value of
``0.weight`` each rank used at each forward is saved to ``side/<phase>-rank<r>-f<i>.npy``
(float64), for the test's numpy reference.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    Sampler,
    TimedSampler,
    inject_observer,
    remove_observer,
)


def sampler(spec: str) -> Sampler:
    """The sampler a settings string names: ``every:N``, ``always`` or ``timed:SECONDS``."""
    kind, _, argument = spec.partition(":")
    if kind == "every":
        return EveryNForwardsSampler(int(argument))
    if kind == "always":
        return AlwaysSampler()
    if kind == "timed":
        return TimedSampler(float(argument))
    raise ValueError(f"sampler must be every:N, always or timed:SECONDS, got {spec!r}")


def run_phase(rank: int, cfg: dict[str, Any], phase: dict[str, Any]) -> None:
    torch.manual_seed(0)  # the same initial parameters on every rank, as DDP requires
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    inject_observer(
        model,
        output_dir=phase["out"],
        sampler=sampler(cfg["sampler"]),
        rank_policy="all",
        signals=("output", "parameter"),
    )
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    shard = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    side = Path(cfg["side"])
    for step in range(cfg["steps"]):
        if rank == phase.get("perturb_rank") and step == phase["perturb_before"]:
            with torch.no_grad():
                model[0].weight[0, 0] += phase["perturb_by"]
        weight = model[0].weight.detach().double().numpy().copy()
        np.save(side / f"{phase['name']}-rank{rank}-f{step}.npy", weight)
        x = torch.randn(16, 8, generator=shard)
        y = torch.randn(16, 4, generator=shard)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    remove_observer(model)


def worker(rank: int, cfg: dict[str, Any]) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world"],
    )
    for phase in cfg["phases"]:
        run_phase(rank, cfg, phase)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    # What the workers would each import on first use (DDP's construction imports torch._dynamo,
    # seconds each), imported once here; fork: the workers inherit it all.
    import torch._dynamo

    import ti_io
    import ti_io.write.tensorboard_sink  # noqa: F401

    mp.start_processes(worker, args=(settings,), nprocs=settings["world"], start_method="fork")
    sys.stdout.flush()
    os._exit(0)
