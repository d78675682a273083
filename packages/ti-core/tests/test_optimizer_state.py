"""The ``optimizer_state`` signal: an Adam-type optimizer's ``exp_avg``, ``exp_avg_sq`` and the
squared gradient over the bias-corrected second moment, after the first step that follows a
sampled forward, against numpy float64 on the optimizer's own state; the rows it cannot
measure, with why."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _core_helpers import assert_matches, reference, rows, stats
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, remove_observer
from ti_core.capture.updates import (
    NO_MOMENTS_REASON,
    STATE_PARTS,
    STATE_REMOVED_REASON,
    state_path,
)
from ti_schema.testing import assert_history_conforms


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))


def _state_reference(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, Any]:
    state = optimizer.state[param]
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    m = state["exp_avg"].double().numpy()
    v = state["exp_avg_sq"].double().numpy()
    g = param.grad.double().numpy()  # type: ignore[union-attr]
    t = float(state["step"])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = g * g / (v / (1 - group["betas"][1] ** t))
    return {"exp_avg": m, "exp_avg_sq": v, "grad_sq_over_v": ratio}


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_adam_state_after_the_step_that_follows_each_sample(kind: str) -> None:
    model = _model()
    make = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    optimizer = make(model.parameters(), lr=0.05, betas=(0.8, 0.95))
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        signals=("optimizer_state", "parameter_update"),
    )
    gen = torch.Generator().manual_seed(1)
    expected: list[dict[str, Any]] = []
    for _ in range(3):  # bias correction differs per step
        model(torch.randn(8, 6, generator=gen)).pow(2).mean().backward()
        optimizer.step()
        expected.append(
            {name: _state_reference(optimizer, p) for name, p in model.named_parameters()}
        )
        optimizer.zero_grad()
    remove_observer(model)
    table = sink.table()
    assert_history_conforms(table)
    states = rows(table, signal="optimizer_state", metric="mean")
    assert {r["tensor_path"] for r in states} == {
        state_path(name, part) for name in ("weight", "bias") for part in STATE_PARTS
    }
    assert {r["layer"] for r in states} == {"0", "2"}
    for sample, by_param in enumerate(expected):
        for name, parts in by_param.items():
            layer, attribute = name.split(".")
            for part, values in parts.items():
                got = stats(
                    table,
                    sample_id=sample,
                    signal="optimizer_state",
                    layer=layer,
                    tensor_path=f"{attribute}.{part}",
                )
                assert_matches(got, reference(values), rtol=1e-6)
    assert rows(table, signal="parameter_update", metric="mean")  # both signals at one step


def test_an_optimizer_without_moments_and_a_removal_before_the_step_say_why() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sink = MemorySink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), signals=("optimizer_state",)
    )
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    model(torch.randn(4, 6)).sum().backward()  # no step before the removal
    remove_observer(model)
    table = sink.table()
    assert_history_conforms(table)
    first = rows(table, signal="optimizer_state", sample_id=0)
    assert first
    assert all(r["value"] is None for r in first)
    assert {r["unavailable_reason"] for r in first} == {NO_MOMENTS_REASON.format(optimizer="SGD")}
    assert {r["tensor_path"] for r in first} == {
        state_path(name, part) for name in ("weight", "bias") for part in STATE_PARTS
    }
    second = rows(table, signal="optimizer_state", sample_id=1)
    assert {r["unavailable_reason"] for r in second} == {STATE_REMOVED_REASON}


def test_state_paths_keep_a_dtensor_placement_last() -> None:
    assert state_path("weight", "exp_avg") == "weight.exp_avg"
    assert state_path("weight@S(0)", "exp_avg_sq") == "weight.exp_avg_sq@S(0)"
    assert state_path("bias@S(0)#0,2", "grad_sq_over_v") == "bias.grad_sq_over_v@S(0)#0,2"
