"""The benchmark workloads: a model, a way to make its input and one training (or inference) step.

Each workload is the published reference one (benchmarks/README.md) so figures compare with the
released single-package torchinstruments: ``sequence``, ``many`` and ``large`` define the cost
targets; ``conv`` and ``transformer`` add realism. The step is what the ratio is taken against, so
it is exactly what a training loop would run per batch, with nothing the observer could hide
behind: forward, then backward of ``.square().mean()``, the input requiring grad (the
predecessor's reference step; before the sampled-step targets the harness ran ``.sum()``
without input gradients, and ``large`` forward only, under ``no_grad``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by build(), so run.py's parent process never loads it
    import torch
    from torch import nn

# The ``impl`` of a spec, shared by run.py (which picks the interpreter) and worker.py (which
# imports the implementation): this tree's ti_core is "ti".
BASELINE = "ti-0.8.0"
"""The released torchinstruments 0.8.0 (run.py --baseline-python)."""
REFERENCE = "ti-ref"
"""ti_core of another tree (run.py --reference-python): the same harness, another install."""

LARGE_NUMEL = 16_777_217
"""2**24 + 1 float32 elements: odd, so the median is one order statistic; quartiles interpolate."""


@dataclass(frozen=True)
class Defaults:
    """Per-workload timing plan: warmup steps, steps per timed block, timed blocks (repeats)."""

    warmup: int
    steps: int
    repeats: int
    every_steps: int  # steps per block when sampling every forward (much slower)
    interval_steps: int  # total steps of the default 60-s interval configuration


@dataclass
class Workload:
    """A built workload: ``step()`` runs one step; ``last_input`` is what the step consumed."""

    name: str
    model: nn.Module
    step: Callable[[], None]
    tensor_bytes: int = 0
    last_input: Callable[[], torch.Tensor] | None = None


DEFAULTS: dict[str, Defaults] = {
    "sequence": Defaults(warmup=20, steps=50, repeats=7, every_steps=10, interval_steps=10_000),
    # every_steps=8: a timed block of `many` makes ~144,000 history rows, more than two parts
    # at the default buffer_rows (65,536), so no block's median hides the part writer's work.
    "many": Defaults(warmup=5, steps=20, repeats=7, every_steps=8, interval_steps=1_000),
    "large": Defaults(warmup=2, steps=1, repeats=5, every_steps=1, interval_steps=20),
    "conv": Defaults(warmup=5, steps=20, repeats=7, every_steps=5, interval_steps=1_000),
    "transformer": Defaults(warmup=5, steps=20, repeats=7, every_steps=5, interval_steps=1_000),
    "gpt2": Defaults(warmup=2, steps=3, repeats=5, every_steps=1, interval_steps=20),
}
QUICK = Defaults(warmup=2, steps=3, repeats=3, every_steps=2, interval_steps=30)

DESCRIPTIONS = {
    "sequence": "4 x nn.Linear(128,128), input (2,128,128) float32, forward + backward",
    "many": "nn.Linear(8,8) + 1,000 nn.Identity, input (2,8), forward + backward",
    "large": "nn.Identity on a fresh torch.randn(16,777,217) float32 per step, forward + backward",
    "conv": "2 x Conv2d+ReLU, pool, Linear; input (8,3,32,32), forward + backward",
    "transformer": "nn.TransformerEncoderLayer(128, 4 heads, ff 256), input (4,32,128), fwd + bwd",
    "gpt2": "transformers GPT2LMHeadModel(GPT2Config()), 124M parameters, 12 blocks, input ids"
    " (1,32), fwd + bwd of the logits (needs transformers)",
    "history": "DirectorySink.close() on a synthetic 900,000-row history",
}


def _train_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """Forward, then backward of ``.square().mean()``; ``x`` requires grad."""

    def step() -> None:
        model(x).square().mean().backward()

    return step


def build(name: str, device: str = "cpu") -> Workload:
    """Build workload ``name`` on ``device`` (deterministic: seeded weights and inputs)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    dev = torch.device(device)
    model: nn.Module
    if name == "sequence":
        model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]).to(dev)
        x = torch.randn(2, 128, 128, device=dev, requires_grad=True)
        return Workload(name, model, _train_step(model, x))
    if name == "many":
        model = nn.Sequential(nn.Linear(8, 8), *[nn.Identity() for _ in range(1000)]).to(dev)
        x = torch.randn(2, 8, device=dev, requires_grad=True)
        return Workload(name, model, _train_step(model, x))
    if name == "conv":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        ).to(dev)
        x = torch.randn(8, 3, 32, 32, device=dev, requires_grad=True)
        return Workload(name, model, _train_step(model, x))
    if name == "transformer":
        model = nn.TransformerEncoderLayer(
            d_model=128, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True
        ).to(dev)
        x = torch.randn(4, 32, 128, device=dev, requires_grad=True)
        return Workload(name, model, _train_step(model, x))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config()).to(dev)  # GPT-2 small's shape, random weights
        model.train()
        ids = torch.randint(0, model.config.vocab_size, (1, 32), device=dev)

        def step() -> None:
            model(input_ids=ids).logits.square().mean().backward()

        return Workload(name, model, step)
    if name == "large":
        model = nn.Identity().to(dev)
        generator = torch.Generator(device=dev).manual_seed(0)
        holder: list[torch.Tensor] = []

        def step() -> None:
            # A fresh batch per step, as a data loader would deliver it; the reduction of the
            # output (the same tensor, Identity) is what the observer adds. That output is the
            # input itself, a leaf: its gradient is not captured (a gap row says so).
            x = torch.randn(LARGE_NUMEL, generator=generator, device=dev, requires_grad=True)
            holder[:] = [x]
            model(x).square().mean().backward()

        return Workload(name, model, step, LARGE_NUMEL * 4, lambda: holder[0])
    raise ValueError(f"unknown workload {name!r}; choose from {sorted(DEFAULTS)}")
