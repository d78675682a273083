"""The deterministic training harness behind every matched run.

Ownership: :func:`run_variant` attaches the observer, trains, and removes the observer in a
``finally`` block, so the artifacts are finalized even when training raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ti_core import EveryNForwardsSampler, inject_observer, remove_observer
from ti_examples.problems import IN_FEATURES, Problem, Variant

HEALTHY_SAMPLES = 4
"""Samples taken before the fault starts, so the onset is visible against a healthy history."""


@dataclass(frozen=True)
class ExperimentConfig:
    """Sizes shared by the three runs of every experiment."""

    steps: int = 60
    sample_every: int = 5
    seed: int = 0
    batch_size: int = 64

    def __post_init__(self) -> None:
        if self.sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every}")
        if self.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2, got {self.batch_size}")
        minimum = self.onset_step + self.sample_every
        if self.steps < minimum:
            raise ValueError(
                f"steps must be >= {minimum} (four healthy samples every {self.sample_every} "
                f"steps, then at least one sample after the fault), got {self.steps}"
            )

    @property
    def onset_step(self) -> int:
        """The training step (and root forward index) at which the fault starts."""
        return HEALTHY_SAMPLES * self.sample_every


def make_batches(config: ExperimentConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of a fixed regression task: ``y = teacher(x)`` with Gaussian ``x``.

    Generated from ``config.seed`` alone, so every variant trains on exactly the same data.
    """
    gen = torch.Generator().manual_seed(config.seed)
    w1 = torch.randn(IN_FEATURES, 8, generator=gen) / IN_FEATURES**0.5
    w2 = torch.randn(8, 1, generator=gen) / 8**0.5
    batches = []
    for _ in range(config.steps):
        x = torch.randn(config.batch_size, IN_FEATURES, generator=gen)
        y = torch.tanh(x @ w1) @ w2
        batches.append((x, y))
    return batches


def train(
    problem: Problem,
    variant: Variant,
    model: nn.Module,
    config: ExperimentConfig,
) -> list[float]:
    """Train ``model`` for ``config.steps`` steps; returns the loss of every step."""
    optimizer = problem.optimizer(model)
    losses = []
    for step, (x, y) in enumerate(make_batches(config)):
        faulty = variant != "baseline" and step >= config.onset_step
        if faulty and step == config.onset_step:
            problem.start_fault(model, optimizer)
        optimizer.zero_grad()
        prediction = model(problem.inputs(x, faulty=faulty))
        loss = nn.functional.mse_loss(prediction, y)
        loss.backward()  # type: ignore[no-untyped-call]
        problem.before_step(model, variant)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def run_variant(
    problem: Problem,
    variant: Variant,
    output_dir: Path,
    config: ExperimentConfig,
) -> list[float]:
    """One observed run: writes the full artifact set of ``variant`` to ``output_dir``."""
    torch.manual_seed(config.seed)
    model = problem.build_model(variant)
    inject_observer(
        model,
        output_dir=output_dir,
        sampler=EveryNForwardsSampler(config.sample_every),
        signals=problem.signals,
        selector=problem.selector(),
        sentinel=problem.sentinel and variant == "broken",
    )
    try:
        return train(problem, variant, model, config)
    finally:
        remove_observer(model)
