"""Where the flight recorder's dense mode (``Sentinel(mode="dense")``) spends its time: each
piece turned into a no-op. (Replay mode, the default: ``sentinel_replay.py``.)

One process per mode. It builds a bare model and observed copies (``EveryNForwardsSampler``
that never samples again, so every timed forward is unsampled), then times short blocks of
each variant in shuffled order per round and reports each variant's median block time over
the bare one's, and its fastest block over the fastest bare one's (less sensitive to a shared
machine's interruptions). A variant replaces one piece of the recorder by a no-op for its
blocks only, so the difference to ``sentinel`` is that piece's cost inside a real step.

``eager`` (``sequence`` by default; 2 threads, like ``run.py``): ``unsampled`` (the observer
without the sentinel), ``sum-check`` (the CPU check as it was before the BLAS ``dot``: a
``sum`` at every size), ``no-kernel`` (the CPU check ``cpu_nonfinite`` returns False),
``no-add`` (``Flags.add`` does nothing: no kernel, no bookkeeping), ``no-gradient-call``
(gradient pre-hooks registered but not run).

``kernels`` (``sequence`` by default; 2 threads): the CPU check's exact reduction and its
alternatives (BLAS ``dot``, ``sum``, numpy's sum, ``abs().max()``, ``aminmax``), each in turn
as the sentinel's check, timed per checked tensor where it runs, inside the real step.

``compiled`` (``mlp`` or ``block`` from ``compiled.py``; inductor, ``fullgraph=True``, one
thread): ``observer`` (no sentinel), ``outputs`` (``Sentinel(signals=("output",))``),
``sentinel``, and each of the last two with ``FlightRecorder.end`` reduced to forgetting the
forward (no flag or slot read).

    python benchmarks/sentinel_parts.py eager [--workload sequence] [--rounds 15]
    python benchmarks/sentinel_parts.py compiled [--workload mlp] [--rounds 25]
    python benchmarks/sentinel_parts.py kernels [--workload sequence] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import sys

if len(sys.argv) > 1 and sys.argv[1] == "compiled":
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import copy
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compiled as compiled_bench
import workloads

import ti_core
from ti_core import EveryNForwardsSampler, MemorySink, Sentinel
from ti_core.sentinel import flags, recorder

Step = Callable[[], None]
DENSE = Sentinel(mode="dense")


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _forget(self: recorder.FlightRecorder, current: object = None) -> None:
    self._local.forward = None


def _observe(model: torch.nn.Module, sentinel: bool | Sentinel) -> None:
    ti_core.inject_observer(
        model,
        output_dir=None,
        sink=MemorySink(),
        sampler=EveryNForwardsSampler(10**9),
        sentinel=sentinel,
        handle_sigterm=False,
    )


def _sum_check(tensor: torch.Tensor) -> bool | None:
    """``cpu_nonfinite`` before the BLAS ``dot``: a ``sum`` at every size."""
    values = flags.real_values(tensor)
    if values is None:
        return None
    half = values.dtype in (torch.float16, torch.bfloat16)
    total = values.sum(dtype=torch.float32) if half else values.sum()
    if math.isfinite(total.item()):
        return False
    low, high = torch.aminmax(values)
    return not (math.isfinite(low.item()) and math.isfinite(high.item()))


def _eager(workload: str) -> tuple[Step, dict[str, tuple[Step, Callable[[], Any]]]]:
    torch.set_num_threads(2)
    bare = workloads.build(workload)
    unsampled = workloads.build(workload)
    _observe(unsampled.model, False)
    observed = workloads.build(workload)
    _observe(observed.model, DENSE)
    plain = nullcontext
    return bare.step, {
        "unsampled": (unsampled.step, plain),
        "sentinel": (observed.step, plain),
        "sum-check": (observed.step, lambda: _patched(flags, "cpu_nonfinite", _sum_check)),
        "no-kernel": (observed.step, lambda: _patched(flags, "cpu_nonfinite", lambda t: False)),
        "no-add": (observed.step, lambda: _patched(flags.Flags, "add", lambda *a: None)),
        "no-gradient-call": (
            observed.step,
            lambda: _patched(recorder.GradientCheck, "__call__", lambda self, g: None),
        ),
    }


def _compiled(workload: str) -> tuple[Step, dict[str, tuple[Step, Callable[[], Any]]]]:
    torch.set_num_threads(1)
    base, shape = compiled_bench._build(workload)
    x = torch.randn(*shape)

    def compiled(tag: str, sentinel: bool | Sentinel | None) -> Step:
        model = torch.compile(compiled_bench._own_code(copy.deepcopy(base), tag), fullgraph=True)
        if sentinel is not None:
            _observe(model, sentinel)
        return lambda: model(x).sum().backward()

    outputs = compiled("outputs", Sentinel(signals=("output",), mode="dense"))
    full = compiled("sentinel", DENSE)
    no_end = lambda: _patched(recorder.FlightRecorder, "end", _forget)  # noqa: E731
    return compiled("bare", None), {
        "observer": (compiled("observer", False), nullcontext),
        "outputs": (outputs, nullcontext),
        "outputs, no end": (outputs, no_end),
        "sentinel": (full, nullcontext),
        "sentinel, no end": (full, no_end),
    }


def _reductions() -> dict[str, Callable[[torch.Tensor], bool]]:
    """Exact non-finite tests of a CPU tensor by one read each (True: non-finite)."""

    def dot(tensor: torch.Tensor) -> bool:
        flat = tensor.data.reshape(-1)
        return not math.isfinite(torch.dot(flat, flat).item())

    current = flags.cpu_nonfinite  # (bound now: the timed runs patch the module's name)
    return {
        "cpu_nonfinite": lambda t: bool(current(t)),
        "dot": dot,
        "sum": lambda t: not math.isfinite(t.data.sum().item()),
        "numpy sum": lambda t: not math.isfinite(float(t.data.numpy().sum())),
        "abs max": lambda t: not math.isfinite(t.data.abs().max().item()),
        "aminmax": lambda t: not all(math.isfinite(v.item()) for v in torch.aminmax(t.data)),
    }


def _kernels(workload: str, rounds: int, steps: int) -> None:
    """Each exact reduction as the sentinel's CPU check, timed where it runs: inside a real
    step (its wall time per checked tensor, a ``perf_counter`` around each check), the
    reductions taking turns in blocks of ``steps`` steps."""
    torch.set_num_threads(2)
    observed = workloads.build(workload)
    _observe(observed.model, DENSE)
    taken: dict[str, list[float]] = {}

    def timed(name: str, check: Callable[[torch.Tensor], bool]) -> Callable[[Any], bool]:
        spent = taken.setdefault(name, [])

        def run(tensor: torch.Tensor) -> bool:
            start = time.perf_counter()
            flagged = check(tensor)
            spent.append(time.perf_counter() - start)
            return flagged

        return run

    reductions = _reductions()
    checks = {name: timed(name, check) for name, check in reductions.items()}
    order = list(checks)

    def play(count: int) -> None:
        for _ in range(count):
            random.shuffle(order)
            for name in order:
                with _patched(flags, "cpu_nonfinite", checks[name]):
                    for _ in range(steps):
                        observed.step()

    play(1)  # warm-up round, not counted
    for spent in taken.values():
        spent.clear()
    play(rounds)
    print(f"kernels {workload}: per checked tensor inside the step ({rounds} rounds of {steps})")
    for name in reductions:
        spent = sorted(taken[name])
        median, tenth = statistics.median(spent), spent[len(spent) // 10]
        print(f"  {name:18s} median {median * 1e6:6.1f} us  p10 {tenth * 1e6:6.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("eager", "compiled", "kernels"))
    parser.add_argument("--workload", default=None)
    parser.add_argument("--rounds", type=int, default=0, help="0: 15 eager, 25 compiled")
    parser.add_argument("--steps", type=int, default=0, help="steps per block (0: 100 / 50)")
    args = parser.parse_args()
    if args.mode == "kernels":
        _kernels(args.workload or "sequence", args.rounds or 15, args.steps or 100)
        return
    eager = args.mode == "eager"
    workload = args.workload or ("sequence" if eager else "mlp")
    bare, variants = (_eager if eager else _compiled)(workload)
    rounds = args.rounds or (15 if eager else 25)
    steps = args.steps or (100 if eager else 50)
    every: dict[str, tuple[Step, Callable[[], Any]]] = {"bare": (bare, nullcontext), **variants}
    for step, patch in every.values():  # warm up (and compile) every variant
        with patch():
            for _ in range(20):
                step()
    times: dict[str, list[float]] = {name: [] for name in every}
    order = list(every)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            step, patch = every[name]
            with patch():
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                times[name].append((time.perf_counter() - start) / steps)
    base = statistics.median(times["bare"])
    fastest = min(times["bare"])
    print(f"{args.mode} {workload}: bare step {base * 1e6:.0f} us ({rounds} rounds of {steps})")
    for name in variants:
        median = statistics.median(times[name])
        low = min(times[name])  # fastest block against the fastest bare one: the least noisy
        print(
            f"  {name:18s} {median / base:.3f}x  ({(median - base) * 1e6:+.0f} us)"
            f"  fastest {low / fastest:.3f}x  ({(low - fastest) * 1e6:+.0f} us)"
        )


if __name__ == "__main__":
    main()
