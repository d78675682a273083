"""Profile one workload/configuration in-process with cProfile (the evidence for optimizations).

    python benchmarks/profile_workload.py sequence every --steps 20 [--sink memory] [--top 25]
    python benchmarks/profile_workload.py large every --steps 3 --save /tmp/large.pstats

Prints the top functions by own time (tottime) and by cumulative time, restricted to the timed
steps (setup, warmup and removal are excluded; ``--removal`` profiles removal instead).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads
from worker import _Impl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(workloads.DEFAULTS))
    parser.add_argument("config", choices=("bare", "unsampled", "every", "interval"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sink", default="dir", choices=("dir", "memory"))
    parser.add_argument("--impl", default="ti", choices=("ti", "ti-0.8.0"))
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--removal", action="store_true", help="profile remove_observer")
    parser.add_argument("--save", type=Path, help="also dump the pstats file here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = workloads.build(args.workload)
    impl = None if args.config == "bare" else _Impl(args.impl)
    profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory(prefix="ti-profile-") as tmp:
        if impl is not None:
            impl.inject(work.model, args.config, args.sink, Path(tmp) / "stats")
        for _ in range(args.warmup):
            work.step()
        start = time.perf_counter()
        if not args.removal:
            profiler.enable()
        for _ in range(args.steps):
            work.step()
        profiler.disable()
        elapsed = time.perf_counter() - start
        if impl is not None:
            if args.removal:
                profiler.enable()
            start_removal = time.perf_counter()
            impl.remove(work.model)
            profiler.disable()
            print(f"removal {time.perf_counter() - start_removal:.3f} s")
    print(f"{args.steps} steps in {elapsed:.3f} s ({elapsed / args.steps * 1e3:.3f} ms/step)")
    if args.save:
        profiler.dump_stats(args.save)
    for key in ("tottime", "cumulative"):
        buffer = io.StringIO()
        stats = pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats(key)
        stats.print_stats(args.top)
        print(f"==== by {key} ====")
        print(buffer.getvalue().split("\n", 6)[-1] if key else buffer.getvalue())


if __name__ == "__main__":
    main()
