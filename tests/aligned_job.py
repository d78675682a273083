"""A data-parallel job observed on every rank with the default timed sampler, for aligned
sampling and replica drift.

``python aligned_job.py SETTINGS_JSON`` imports torch and ti-core once, then forks ``world``
processes (``torch.multiprocessing``, gloo on CPU). Each phase (``run_phase``) trains a fresh
small model under DDP for ``steps`` steps, every rank on its own data shard, observed with
``rank_policy="all"`` into ``phase["out"]``. Settings of a phase:

- ``interval``: seconds of the default timed sampler (``inject_observer(interval=...)``);
- ``store``: ``"default"`` (the process group's store, found by ``inject_observer``) or
  ``"raising"`` (``AlignedSampler(TimedSampler(interval), store=RaisingStore())``: every store
  call raises);
- ``start_gap``: rank ``r`` sleeps ``(world - 1 - r) * start_gap`` seconds before attaching, so
  the ranks attach seconds apart and the last rank attaches first;
- ``slow_rank`` / ``slow_seconds``: that rank sleeps this long before each forward;
- ``perturb_rank`` / ``perturb_step`` / ``perturb_by``: add ``perturb_by`` to
  ``0.weight[0, 0]`` on that rank just before forward ``perturb_step`` (after the optimizer step
  of the forward before it), so that rank's replica forks from then on;
- ``signals``: the signals to record (default ``["output", "output_gradient"]``);
- ``save_weights``: save the value of ``0.weight`` this rank used at each forward to
  ``side/<phase>-rank<r>-f<i>.npy`` (float64), for the test's numpy reference.

Each rank writes ``side/<phase>-rank<r>.json``: its run settings and the TelemetryWarnings it
saw (their messages).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ti_core import (
    AlignedSampler,
    TelemetryWarning,
    TimedSampler,
    inject_observer,
    observer_of,
    remove_observer,
)


class RaisingStore:
    """A store every call of which raises, as an unreachable one would."""

    def set(self, key: str, value: str) -> None:
        raise RuntimeError("store unreachable")

    def get(self, key: str) -> bytes:
        raise RuntimeError("store unreachable")

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("store unreachable")

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        raise RuntimeError("store unreachable")


def run_phase(rank: int, world: int, side: Path, phase: dict[str, Any]) -> None:
    """One phase on this rank (settings in the module docstring)."""
    torch.manual_seed(0)  # the same initial parameters on every rank, as DDP requires
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    time.sleep((world - 1 - rank) * phase.get("start_gap", 0.0))
    options: dict[str, Any] = {}
    if phase.get("store", "default") == "raising":
        options["sampler"] = AlignedSampler(TimedSampler(phase["interval"]), store=RaisingStore())
    else:
        options["interval"] = phase["interval"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TelemetryWarning)
        inject_observer(
            model,
            output_dir=phase["out"],
            rank_policy="all",
            signals=tuple(phase.get("signals", ("output", "output_gradient"))),
            **options,
        )
        observer = observer_of(model)
        settings = dict(observer.run.settings) if observer is not None else {}
        net = torch.nn.parallel.DistributedDataParallel(model)  # syncs the ranks: lockstep
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        shard = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
        for step in range(phase["steps"]):
            if rank == phase.get("slow_rank"):
                time.sleep(phase["slow_seconds"])
            if rank == phase.get("perturb_rank") and step == phase["perturb_step"]:
                with torch.no_grad():
                    model[0].weight[0, 0] += phase["perturb_by"]
            if phase.get("save_weights"):
                weight = model[0].weight.detach().double().numpy()
                np.save(side / f"{phase['name']}-rank{rank}-f{step}.npy", weight)
            x = torch.randn(16, 8, generator=shard)
            y = torch.randn(16, 4, generator=shard)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        remove_observer(model)
    record = {
        "settings": settings,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, TelemetryWarning)],
    }
    (side / f"{phase['name']}-rank{rank}.json").write_text(json.dumps(record))


def worker(rank: int, cfg: dict[str, Any]) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world"],
    )
    for phase in cfg["phases"]:
        run_phase(rank, cfg["world"], Path(cfg["side"]), phase)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    # DDP's constructor imports torch._dynamo (seconds): once here rather than in every rank
    import torch._dynamo

    # fork: the workers inherit the imported torch and ti-core instead of importing them again
    mp.start_processes(worker, args=(settings,), nprocs=settings["world"], start_method="fork")
    sys.stdout.flush()
    os._exit(0)
