"""The flight recorder's cost with its default replay mode, side by side in one process.

Per workload, one process builds a bare model and observed copies (``EveryNForwardsSampler``
that never samples again: every timed forward is unsampled), warms them up, then times short
blocks of each variant in shuffled order per round; it reports each variant's median block
time over the bare one's (and its fastest block over the fastest bare one's, less sensitive to
a shared machine's interruptions). Variants: ``observer`` (``sentinel=False``: the observer's
own cost), ``replay`` (the default sentinel: root checks), and, eager, ``dense``
(``Sentinel(mode="dense")``: every module checked on every forward).

Then the cost of the replay itself, which runs only at an event: the median time of a replay
of a real step's forward (``signal="output"``) and of its forward and backward
(``"output_gradient"``), each over the bare step. A clean step replays clean
(``not_reproduced``); what it costs is the same as a replay that finds something.

Eager workloads (``sequence``, ``gpt2``, ``transformer``; two intra-op threads) come from
``workloads.py``; compiled ones (``mlp``, ``block``; inductor, ``fullgraph=True``, one thread)
from ``compiled.py``.

    python benchmarks/sentinel_replay.py --workloads sequence,gpt2,mlp,block
    python benchmarks/sentinel_replay.py --workloads sequence --rounds 31 --steps 100
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compiled as compiled_bench
import workloads

import ti_core
from ti_core import EveryNForwardsSampler, MemorySink, Sentinel, observer_of
from ti_core.sentinel.replay import StepRecord
from ti_core.tensor_paths import tensor_leaves

Step = Callable[[], None]
EAGER = ("sequence", "gpt2", "transformer")
COMPILED = ("mlp", "block")
TARGETS = {"sequence": 1.03, "gpt2": 1.02}
"""Replay mode over the bare step; compiled: the observer's own cost + 0.02x."""


def _observe(model: torch.nn.Module, sentinel: bool | Sentinel) -> None:
    ti_core.inject_observer(
        model,
        output_dir=None,
        sink=MemorySink(),
        sampler=EveryNForwardsSampler(10**9),
        sentinel=sentinel,
        handle_sigterm=False,
    )


def _eager(name: str) -> tuple[Step, dict[str, Step], workloads.Workload]:
    torch.set_num_threads(2)
    bare = workloads.build(name)
    variants: dict[str, Step] = {}
    replayed = None
    for label, sentinel in (
        ("observer", False),
        ("replay", True),
        ("dense", Sentinel(mode="dense")),
    ):
        built = workloads.build(name)
        _observe(built.model, sentinel)
        variants[label] = built.step
        if label == "replay":
            replayed = built
    assert replayed is not None
    return bare.step, variants, replayed


def _compiled(name: str) -> tuple[Step, dict[str, Step], None]:
    torch.set_num_threads(1)
    base, shape = compiled_bench._build(name)
    x = torch.randn(*shape)

    def compiled(tag: str, sentinel: bool | None) -> Step:
        model = torch.compile(compiled_bench._own_code(copy.deepcopy(base), tag), fullgraph=True)
        if sentinel is not None:
            _observe(model, sentinel)
        return lambda: model(x).sum().backward()

    return (
        compiled("bare", None),
        {"observer": compiled("observer", False), "replay": compiled("replay", True)},
        None,
    )


def _replay_cost(built: workloads.Workload, bare_step: float, repeats: int) -> dict[str, float]:
    """A replay of one real step of ``built`` (observed, replay mode), forward only and with
    its backward, each timed ``repeats`` times: median seconds over the bare step's."""
    observer = observer_of(built.model)
    assert observer is not None
    replayer = observer.recorder._replayer
    assert replayer is not None
    captured: dict[str, Any] = {}

    def keep(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured["step"] = StepRecord(args, kwargs)

    def grads(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        leaves = tensor_leaves(output)
        step: StepRecord = captured["step"]
        for position, (_, tensor) in enumerate(leaves):
            if tensor.requires_grad and tensor.is_floating_point():
                step.output_grads[position] = torch.ones_like(tensor) / tensor.numel()

    handles = [
        built.model.register_forward_pre_hook(keep, with_kwargs=True),
        built.model.register_forward_hook(grads, with_kwargs=True),
    ]
    built.step()
    for handle in handles:
        handle.remove()
    step: StepRecord = captured["step"]
    found: dict[str, float] = {}
    for signal in ("output", "output_gradient"):
        spent = []
        for _ in range(repeats):
            start = time.perf_counter()
            verdict = replayer.replay(step, signal, "cpu")
            spent.append(time.perf_counter() - start)
            assert verdict.replay == "not_reproduced", verdict
        found[signal] = statistics.median(spent) / bare_step
    return found


def run(name: str, rounds: int, steps: int) -> None:
    eager = name in EAGER
    bare, variants, replayed = _eager(name) if eager else _compiled(name)
    every: dict[str, Step] = {"bare": bare, **variants}
    warm = 3 if name == "gpt2" else 20
    for step in every.values():  # warm up (and compile) every variant
        for _ in range(warm):
            step()
    times: dict[str, list[float]] = {label: [] for label in every}
    order = list(every)
    for _ in range(rounds):
        random.shuffle(order)
        for label in order:
            step = every[label]
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[label].append((time.perf_counter() - start) / steps)
    base = statistics.median(times["bare"])
    fastest = min(times["bare"])
    kind = "eager" if eager else "compiled"
    print(f"{name} ({kind}): bare step {base * 1e6:.0f} us ({rounds} rounds of {steps} steps)")
    ratios = {}
    for label in variants:
        median = statistics.median(times[label])
        ratios[label] = median / base
        low = min(times[label])
        print(
            f"  {label:10s} {median / base:.3f}x  ({(median - base) * 1e6:+.0f} us)"
            f"  fastest {low / fastest:.3f}x  ({(low - fastest) * 1e6:+.0f} us)"
        )
    limit = TARGETS.get(name)
    if limit is None:
        limit = ratios["observer"] + 0.02
        rule = f"observer {ratios['observer']:.3f}x + 0.02x"
    else:
        rule = f"{limit:g}x"
    verdict = "PASS" if ratios["replay"] <= limit else "FAIL"
    print(f"  target: replay <= {rule}: {ratios['replay']:.3f}x {verdict}")
    if replayed is not None:
        cost = _replay_cost(replayed, base, max(3, rounds // 3))
        print(
            f"  one replay, at an event: forward {cost['output']:.2f}x of the bare step, "
            f"forward and backward {cost['output_gradient']:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="sequence,gpt2,mlp,block")
    parser.add_argument("--rounds", type=int, default=0, help="0: 21 (gpt2: 5)")
    parser.add_argument("--steps", type=int, default=0, help="0: 100 eager, 50 compiled (gpt2 2)")
    args = parser.parse_args()
    for name in args.workloads.split(","):
        if name not in EAGER + COMPILED:
            parser.error(f"--workloads: unknown {name!r}; choose from {EAGER + COMPILED}")
        rounds = args.rounds or (5 if name == "gpt2" else 21)
        steps = args.steps or (2 if name == "gpt2" else 100 if name in EAGER else 50)
        run(name, rounds, steps)


if __name__ == "__main__":
    main()
