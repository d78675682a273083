"""The model the torchinstruments 0.8.0 tests observe, shared with the killed-run script."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

STEPS = 5


class Split(nn.Module):
    """A leaf whose output is a nested mapping, for 0.8.0's dotted tensor paths."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"main": x * 2, "aux": (x.relu(), x + 1)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.split = Split()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.split(self.encoder(x))
        result: torch.Tensor = self.head(out["main"] + out["aux"][1])
        return result


def train_steps(model: nn.Module, steps: int, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # an evaluation forward: a sample without backward
        model.eval()
        model(torch.randn(2, 6, generator=generator))
        model.train()
