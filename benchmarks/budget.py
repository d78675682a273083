"""Does ``BudgetSampler(fraction=f)`` hold its budget? Measured on the reference workloads.

Each workload x budget runs in a fresh process (``--one``, one JSON line back): the model is
warmed up bare, a block of bare steps gives the bare step time (median of per-step times), then
the observer is attached with ``BudgetSampler(f)`` (and ``MemorySink``) and the loop runs for
``--seconds``. Two figures come back:

- ``measured``: the run's own telemetry cost as ti-core measured it (``RunCost.fraction``: the
  sampled steps' time, and that of the unsampled steps the emission worker overlapped
  (``overlap``), beyond the median clean unsampled step, over the wall time), what the sampler
  steers by;
- ``vs_bare``: independent of the meter, ``1 - steps x bare step / wall``: everything the
  observer cost the loop (unsampled forwards' hooks and emission worker contention included),
  against the bare step measured just before in the same process.

Usage::

    python benchmarks/budget.py                                   # sequence and gpt2, 1 % and 5 %
    python benchmarks/budget.py --workloads sequence --budgets 0.01 --seconds 20
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _one(workload: str, budget: float, seconds: float, device: str) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(HERE))
    import workloads

    from ti_core import BudgetSampler, MemorySink, inject_observer, remove_observer

    torch.set_num_threads(1)
    work = workloads.build(workload, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        work.step()
    bare = []
    deadline = time.perf_counter() + min(seconds / 4, 15.0)
    while time.perf_counter() < deadline or len(bare) < 5:
        sync()
        start = time.perf_counter()
        work.step()
        sync()
        bare.append(time.perf_counter() - start)
    bare_step = statistics.median(bare)
    sink = MemorySink()
    sync()
    start = time.perf_counter()
    inject_observer(work.model, sink=sink, output_dir=None, sampler=BudgetSampler(budget))
    steps = 0
    while time.perf_counter() - start < seconds:
        work.step()
        steps += 1
    sync()
    wall = time.perf_counter() - start
    remove_observer(work.model)
    cost = sink.cost
    assert cost is not None
    return {
        "workload": workload,
        "device": device,
        "budget": budget,
        "steps": steps,
        "sampled": cost.sampled_forwards,
        "overlapped": cost.worker_overlap_steps,
        "bare_step_ms": 1000 * bare_step,
        "median_unsampled_ms": 1000 * (cost.median_unsampled_step_seconds or float("nan")),
        "median_sampled_ms": 1000 * (cost.median_sampled_step_seconds or float("nan")),
        "measured": cost.fraction,
        "vs_bare": 1 - steps * bare_step / wall,
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="sequence,gpt2")
    parser.add_argument("--budgets", default="0.01,0.05")
    parser.add_argument("--seconds", type=float, default=30.0, help="observed loop per run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # workload:budget, in this process
    args = parser.parse_args()
    if args.one:
        workload, budget = args.one.split(":")
        print("RESULT " + json.dumps(_one(workload, float(budget), args.seconds, args.device)))
        return 0
    header = (
        f"{'workload':<10} {'budget':>6} {'steps':>6} {'samples':>7} {'overlap':>7} {'bare ms':>8} "
        f"{'unsampled ms':>12} {'sampled ms':>10} {'measured':>8} {'vs bare':>8}"
    )
    print(header)
    for workload in args.workloads.split(","):
        for budget in args.budgets.split(","):
            command = [sys.executable, __file__, "--one", f"{workload}:{budget}"]
            command += ["--seconds", str(args.seconds), "--device", args.device]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if not lines:
                print(f"{workload} {budget}: failed\n{done.stderr[-2000:]}")
                continue
            r = json.loads(lines[-1][len("RESULT ") :])
            measured = "n/a" if r["measured"] is None else f"{100 * r['measured']:.2f}%"
            print(
                f"{workload:<10} {100 * r['budget']:>5g}% {r['steps']:>6} {r['sampled']:>7} "
                f"{r['overlapped']:>7} "
                f"{r['bare_step_ms']:>8.2f} {r['median_unsampled_ms']:>12.2f} "
                f"{r['median_sampled_ms']:>10.2f} {measured:>8} {100 * r['vs_bare']:>7.2f}%",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
