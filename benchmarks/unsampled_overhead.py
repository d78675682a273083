"""The attached-but-unsampled cost, measured finely enough to judge the 1.02x / 1.05x targets.

The harness (``run.py``) times ``bare`` and ``unsampled`` in separate processes, minutes apart;
on a shared machine their medians drift by more than the 2-5% being judged. Here one process
alternates short blocks of bare steps and attached-but-unsampled steps of the same workload
(``inject_observer`` / ``remove_observer`` between blocks; the one sampled forward after each
attach is not timed), so both see the same machine state, and reports the median of the
per-pair ratios. It also times an attached root forward of a one-``Identity`` model in a tight
loop: the observer's fixed cost per unsampled root forward, in microseconds.

    python benchmarks/unsampled_overhead.py [--workloads sequence,many] [--pairs 21]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads

TARGETS = {"sequence": 1.02, "many": 1.05}


def _block(step: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def workload_pairs(name: str, pairs: int, steps: int, sink: str) -> list[tuple[float, float]]:
    """``pairs`` (bare, unsampled) per-step times of adjacent blocks, order alternating."""
    from ti_core import EveryNForwardsSampler, MemorySink, inject_observer, remove_observer
    from ti_io import DirectorySink

    w = workloads.build(name)
    for _ in range(workloads.DEFAULTS[name].warmup):
        w.step()
    out: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):

            def attached(i: int = i) -> float:
                target = DirectorySink(Path(tmp) / f"run-{i}") if sink == "dir" else MemorySink()
                inject_observer(
                    w.model, sampler=EveryNForwardsSampler(10**9), output_dir=None, sink=target
                )
                try:
                    # Not timed: forward 0 (always sampled), the next one (which removes the
                    # per-module hooks), and the background work of that sample.
                    w.step()
                    w.step()
                    if isinstance(target, DirectorySink):
                        target.flush()
                    else:
                        target.table()
                    return _block(w.step, steps)
                finally:
                    remove_observer(w.model)

            if i % 2:
                un = attached()
                bare = _block(w.step, steps)
            else:
                bare = _block(w.step, steps)
                un = attached()
            out.append((bare, un))
    return out


def root_forward_cost(calls: int = 20_000, rounds: int = 7) -> tuple[float, float]:
    """Median microseconds per root forward of ``Sequential(Identity())``: bare, attached."""
    from ti_core import EveryNForwardsSampler, MemorySink, inject_observer, remove_observer

    model = torch.nn.Sequential(torch.nn.Identity())
    x = torch.zeros(1)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            model(x)
        return (time.perf_counter() - start) / calls * 1e6

    bare, attached = [], []
    for _ in range(rounds):
        bare.append(loop())
        inject_observer(
            model, output_dir=None, sink=MemorySink(), sampler=EveryNForwardsSampler(10**9)
        )
        model(x)
        attached.append(loop())
        remove_observer(model)
    return statistics.median(bare), statistics.median(attached)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="sequence,many")
    parser.add_argument("--pairs", type=int, default=21, help="bare/unsampled block pairs")
    parser.add_argument("--steps", type=int, default=0, help="steps per block (0: workload's)")
    parser.add_argument("--sink", choices=("dir", "memory"), default="dir")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bare_us, attached_us = root_forward_cost()
    print(
        f"root forward (Sequential(Identity())): bare {bare_us:.2f} us, attached-unsampled "
        f"{attached_us:.2f} us: {attached_us - bare_us:.2f} us per unsampled root forward"
    )
    failed = 0
    for name in args.workloads.split(","):
        steps = args.steps or workloads.DEFAULTS[name].steps
        pairs = workload_pairs(name, args.pairs, steps, args.sink)
        ratios = sorted(un / bare for bare, un in pairs)
        ratio = statistics.median(ratios)
        bare_ms = statistics.median(b for b, _ in pairs) * 1e3
        target = TARGETS.get(name)
        verdict = "" if target is None else ("PASS" if ratio <= target else "FAIL")
        failed += verdict == "FAIL"
        fixed = (attached_us - bare_us) / 1e3 / bare_ms
        print(
            f"{name:10s} bare {bare_ms:7.3f} ms/step  unsampled/bare median {ratio:.4f}x "
            f"(pairs {len(pairs)}, quartiles {ratios[len(ratios) // 4]:.3f}-"
            f"{ratios[3 * len(ratios) // 4]:.3f})  fixed cost {fixed:.2%}"
            f"  target <= {target}x {verdict}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
