"""What a sampled tensor-parallel step costs, beside the same local tensors unsharded.

Two gloo ranks (forked from this process), each with a tensor-parallel MLP
(``Linear(d, 4d)`` column-wise, ReLU, ``Linear(4d, d)`` row-wise, DTensor outputs:
``use_local_output=False``) and, unsharded, a plain MLP of this rank's local shapes
(``Linear(d, 4d / world)``, ReLU, ``Linear(4d / world, d)``): the tensors a TP rank measures.
Variants, timed in blocks of ``--steps`` training steps in a shuffled order that every rank
shares (the TP steps' collectives pair up), per round:

- ``tp bare`` / ``tp unsampled`` (observed, ``EveryNForwardsSampler`` that never samples
  again) / ``tp sampled`` (``AlwaysSampler``);
- ``local bare`` / ``local sampled``.

Rank 0 prints each variant's median block time per step (and the CPU time of the training
thread: what the step itself computes, without the waits for the other rank) and the ratios
``tp sampled / tp bare``, ``tp unsampled / tp bare``, ``local sampled / local bare``, and the
milliseconds a sample adds to each: with nothing gathered, a sampled TP step should add what
sampling the local tensors adds.

    python benchmarks/tensor_parallel.py --dim 512 --rounds 9 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ti_core
from ti_core import AlwaysSampler, EveryNForwardsSampler, MemorySink

WORLD = 2
VARIANTS = ("tp bare", "tp unsampled", "tp sampled", "local bare", "local sampled")


def _mlp(d: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))


def _observe(model: nn.Module, sampler: Any) -> None:
    ti_core.inject_observer(
        model,
        output_dir=None,
        sink=MemorySink(),
        sampler=sampler,
        rank_policy="all",
        handle_sigterm=False,
    )


def _steps(cfg: dict[str, Any]) -> tuple[dict[str, Callable[[], None]], list[nn.Module]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    d, batch = cfg["dim"], cfg["batch"]
    mesh = init_device_mesh("cpu", (WORLD,))
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(1))
    plan = {
        "0": ColwiseParallel(use_local_output=False),
        "2": RowwiseParallel(use_local_output=False),
    }
    steps: dict[str, Callable[[], None]] = {}
    models: list[nn.Module] = []
    for name in VARIANTS:
        torch.manual_seed(0)
        if name.startswith("tp"):
            model = _mlp(d, 4 * d)
            parallelize_module(model, mesh, plan)
        else:
            model = _mlp(d, 4 * d // WORLD)
        if name.endswith("unsampled"):
            _observe(model, EveryNForwardsSampler(10**9))
        elif name.endswith("sampled"):
            _observe(model, AlwaysSampler())
        tp = name.startswith("tp")
        models.append(model)

        def step(model: nn.Module = model, tp: bool = tp) -> None:
            out = model(x)
            (out.to_local() if tp else out).pow(2).mean().backward()
            model.zero_grad(set_to_none=True)

        steps[name] = step
    return steps, models


def _worker(rank: int, cfg: dict[str, Any]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=WORLD
    )
    torch.set_num_threads(1)
    steps, models = _steps(cfg)
    for step in steps.values():  # warm up (and take each observer's first sample)
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    order = random.Random(7)  # the same order on every rank: the TP steps' collectives pair up
    for _ in range(cfg["rounds"]):
        names = list(VARIANTS)
        order.shuffle(names)
        for name in names:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(cfg["steps"]):
                steps[name]()
            times[name].append((time.perf_counter() - start) / cfg["steps"])
            cpu[name].append((time.thread_time() - start_cpu) / cfg["steps"])
    for model in models:
        ti_core.remove_observer(model)
    if rank == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        medians.update({f"{name} cpu": statistics.median(t) for name, t in cpu.items()})
        print(json.dumps(medians))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cfg = {**vars(args), "port": port}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the job, its output to the pipe
        os.close(read)
        os.dup2(write, 1)
        import torch.distributed.tensor  # noqa: F401  # once, before the ranks fork

        mp.start_processes(_worker, args=(cfg,), nprocs=WORLD, start_method="fork")
        sys.stdout.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise SystemExit(f"the job failed (status {status}):\n{out}")
    medians = json.loads(out.strip().splitlines()[-1])
    print(f"tensor-parallel MLP, d={args.dim}, batch {args.batch}, {WORLD} gloo ranks (rank 0)")
    for name in VARIANTS:
        print(
            f"  {name:<14} {medians[name] * 1e3:8.3f} ms/step, training thread's CPU "
            f"{medians[name + ' cpu'] * 1e3:8.3f} ms/step"
        )
    for over, under in (
        ("tp unsampled", "tp bare"),
        ("tp sampled", "tp bare"),
        ("local sampled", "local bare"),
    ):
        added = (medians[over] - medians[under]) * 1e3
        added_cpu = (medians[over + " cpu"] - medians[under + " cpu"]) * 1e3
        print(
            f"  {over} / {under}: {medians[over] / medians[under]:.3f}x ({added:+.3f} ms; "
            f"training thread's CPU {added_cpu:+.3f} ms)"
        )


if __name__ == "__main__":
    main()
