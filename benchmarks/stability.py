"""What the stability measurements cost on a sampled step, side by side in one process.

Per workload, one process builds the bare model and observed copies, each trained with AdamW
(the optimizer step inside every timed step), warms them up, then times short blocks of each
variant in shuffled order per round; it reports each variant's median block time over the
bare one's. Variants (every forward sampled, ``AlwaysSampler``, in memory):

- ``default``: the default profile on the default signals (outputs, output gradients);
- ``+stability``: the same with ``metrics=(*DEFAULT_METRICS, *STABILITY_METRICS)``;
- ``+optimizer_state``: the default profile, signals plus ``optimizer_state``;
- ``unsampled +both``: both added, no forward sampled after the first: what a run pays
  between samples for them (nothing beyond the observer's own cost);
- ``+attention`` (GPT-2): the ``attention`` signal, its attention modules selected beside the
  leaves (so the default rows of those modules too).

    python benchmarks/stability.py --workloads gpt2,sequence --rounds 5 --steps 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads

import ti_core
from ti_core import AlwaysSampler, EveryNForwardsSampler, MemorySink
from ti_schema import DEFAULT_METRICS, DEFAULT_SIGNALS, STABILITY_METRICS

Step = Callable[[], None]
STABILITY = (*DEFAULT_METRICS, *STABILITY_METRICS)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "+stability": {"metrics": STABILITY},
    "+optimizer_state": {"signals": (*DEFAULT_SIGNALS, "optimizer_state")},
    "unsampled +both": {
        "metrics": STABILITY,
        "signals": (*DEFAULT_SIGNALS, "optimizer_state"),
        "sampler": EveryNForwardsSampler(10**9),
    },
}


def _with_attention(name: str, module: torch.nn.Module) -> bool:
    """The leaf modules and GPT-2's attention modules (which call the attention function)."""
    return type(module).__name__ == "GPT2Attention" or not any(True for _ in module.children())


ATTENTION: dict[str, Any] = {
    "signals": (*DEFAULT_SIGNALS, "attention"),
    "selector": _with_attention,
}
"""``+attention`` (GPT-2 only): the attention logits of its 12 attention modules, selected
beside the leaves."""


def _trained(name: str, options: dict[str, Any] | None) -> Step:
    built = workloads.build(name)
    optimizer = torch.optim.AdamW(built.model.parameters(), lr=1e-4)
    if options is not None:
        chosen = {"sampler": AlwaysSampler(), **options}
        ti_core.inject_observer(
            built.model, output_dir=None, sink=MemorySink(), handle_sigterm=False, **chosen
        )

    def step() -> None:
        built.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(name: str, rounds: int, steps: int) -> dict[str, float]:
    torch.set_num_threads(2)
    steps_of = {"bare": _trained(name, None)}
    steps_of.update({label: _trained(name, options) for label, options in VARIANTS.items()})
    if name == "gpt2":
        steps_of["+attention"] = _trained(name, ATTENTION)
    for step in steps_of.values():
        step()
        step()
    times: dict[str, list[float]] = {label: [] for label in steps_of}
    order = random.Random(3)
    for _ in range(rounds):
        labels = list(steps_of)
        order.shuffle(labels)
        for label in labels:
            start = time.perf_counter()
            for _ in range(steps):
                steps_of[label]()
            times[label].append((time.perf_counter() - start) / steps)
    return {label: statistics.median(t) for label, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="gpt2,sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    for name in args.workloads.split(","):
        medians = measure(name, args.rounds, args.steps)
        bare = medians["bare"]
        print(f"{name}: bare step with AdamW {bare * 1e3:.2f} ms")
        for label in [label for label in medians if label != "bare"]:
            print(f"  {label:<17} {medians[label] / bare:6.3f}x  {medians[label] * 1e3:9.2f} ms")
        extra = (medians["+stability"] - medians["default"]) / bare
        state = (medians["+optimizer_state"] - medians["default"]) / bare
        line = f"  added to a sampled step: stability {extra:+.3f}x, optimizer_state {state:+.3f}x"
        if "+attention" in medians:
            line += f", attention {(medians['+attention'] - medians['default']) / bare:+.3f}x"
        print(line)


if __name__ == "__main__":
    main()
