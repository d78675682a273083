"""Observing changes nothing: outputs, gradients, RNG state and state_dict are bit-identical."""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import pytest
import torch
from _core_helpers import assert_matches, reference, rows, stats
from torch import nn

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    MemorySink,
    inject_observer,
    remove_observer,
)
from ti_schema.testing import assert_history_conforms


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(10, 32)
        self.drop = nn.Dropout(0.3)
        self.norm = nn.LayerNorm(32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32))
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.embed(x)))
        h = self.norm(h + self.body(h))
        return self.head(h)


def train(model: nn.Module, steps: int) -> dict[str, Any]:
    torch.manual_seed(1234)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(steps, 16, 10)
    target = torch.randint(0, 3, (steps, 16))
    outputs, grads = [], []
    for step in range(steps):
        opt.zero_grad()
        out = model(data[step])
        loss = nn.functional.cross_entropy(out, target[step])
        loss.backward()
        outputs.append(out.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
    return {
        "outputs": outputs,
        "grads": grads,
        "rng": torch.get_rng_state(),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def test_training_is_bit_identical_with_and_without_observer() -> None:
    torch.manual_seed(0)
    plain = Net()
    observed = copy.deepcopy(plain)
    keys_before = list(observed.state_dict())
    expected = train(plain, steps=6)

    sink = MemorySink()
    inject_observer(observed, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(2))
    assert list(observed.state_dict()) == keys_before
    got = train(observed, steps=6)
    remove_observer(observed)

    for a, b in zip(expected["outputs"], got["outputs"], strict=True):
        assert torch.equal(a, b)
    for step_a, step_b in zip(expected["grads"], got["grads"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))
    assert torch.equal(expected["rng"], got["rng"])
    assert expected["state"].keys() == got["state"].keys()
    assert all(torch.equal(expected["state"][k], got["state"][k]) for k in expected["state"])
    table = sink.table()
    assert_history_conforms(table)
    assert sorted({r["forward_index"] for r in rows(table)}) == [0, 2, 4]
    assert {r["layer"] for r in rows(table)} == {
        "embed",
        "drop",
        "norm",
        "body.0",
        "body.1",
        "body.2",
        "body.3",
        "head",
    }


def test_threads_keep_their_own_samples() -> None:
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Tanh())
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    inputs = {i: torch.full((2, 4), float(i + 1), dtype=torch.float64) / 10 for i in range(4)}
    scales = {i: float(i + 1) for i in range(4)}
    barrier = threading.Barrier(4)
    failures: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(5):
                out = model(inputs[i])
                (scales[i] * out.sum()).backward()
        except BaseException as error:  # pragma: no cover - reported below
            failures.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    remove_observer(model)
    assert not failures
    table = sink.table()
    assert len({r["sample_id"] for r in rows(table)}) == 20
    with torch.no_grad():
        expected_out = {i: model(x).numpy() for i, x in inputs.items()}
    # identify each sample's thread by its Tanh output and check its gradient matches that thread
    for sample in range(20):
        out_mean = stats(table, sample_id=sample, layer="1", signal="output")["mean"]
        owner = min(expected_out, key=lambda i: abs(expected_out[i].mean() - out_mean))
        assert_matches(
            stats(table, sample_id=sample, layer="1", signal="output"),
            reference(expected_out[owner]),
        )
        assert_matches(
            stats(table, sample_id=sample, layer="1", signal="output_gradient"),
            reference(np.full((2, 4), scales[owner])),
        )


def _signature(sink: MemorySink) -> list[tuple[object, ...]]:
    return sorted(
        (r["forward_index"], r["layer"], r["call_index"], r["signal"], r["metric"], r["value"])
        for r in sink.table().to_pylist()
    )


@pytest.mark.slow
def test_torch_compile_before_or_after_injection_records_eager_statistics() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)

    def run(compile_first: bool | None) -> MemorySink:
        model = copy.deepcopy(base)
        sink = MemorySink()
        if compile_first is None:
            target: nn.Module = model
            inject_observer(target, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(2))
        elif compile_first:
            target = torch.compile(model, backend="aot_eager")  # type: ignore[assignment]
            inject_observer(target, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(2))
        else:
            inject_observer(model, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(2))
            target = torch.compile(model, backend="aot_eager")  # type: ignore[assignment]
        for _ in range(4):
            target(x).sum().backward()
        remove_observer(target if compile_first else model)
        return sink

    eager = _signature(run(None))
    assert {r[1] for r in eager} == {"0", "1", "2"}
    for compile_first in (True, False):
        got = _signature(run(compile_first))
        assert [r[:5] for r in got] == [r[:5] for r in eager]
        np.testing.assert_allclose(
            [np.nan if r[5] is None else r[5] for r in got],
            [np.nan if r[5] is None else r[5] for r in eager],
            rtol=1e-5,
            atol=1e-7,
        )


@pytest.mark.slow
def test_data_parallel_wrappers_report_the_bare_models_names_and_values() -> None:
    """``DataParallel`` (which runs the module itself on a CPU-only machine), alone and nested
    with ``torch.compile`` either way: the layers are named as in the bare model's
    ``named_modules()`` (no ``module.`` or ``_orig_mod.`` prefix) and measure the same values.
    DistributedDataParallel and FSDP2 are shown with real processes in tests/test_dist_e2e.py."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    wrappers: dict[str, Any] = {
        "bare": lambda m: m,
        "DataParallel": nn.DataParallel,
        "DataParallel(compile)": lambda m: nn.DataParallel(torch.compile(m, backend="eager")),
        "compile(DataParallel)": lambda m: torch.compile(nn.DataParallel(m), backend="eager"),
    }
    signatures = {}
    for name, wrap in wrappers.items():
        model = copy.deepcopy(base)
        wrapped = wrap(model)
        sink = MemorySink()
        inject_observer(wrapped, output_dir=None, sink=sink, sampler=AlwaysSampler())
        for _ in range(2):
            wrapped(x).sum().backward()
        remove_observer(wrapped)
        assert [layer.name for layer in sink.runs[0].layers] == ["0", "1", "2"], name
        signatures[name] = _signature(sink)
    bare = signatures.pop("bare")
    assert {r[1] for r in bare} == {"0", "1", "2"}
    for name, got in signatures.items():
        assert [r[:5] for r in got] == [r[:5] for r in bare], name
        np.testing.assert_allclose(
            [np.nan if r[5] is None else r[5] for r in got],
            [np.nan if r[5] is None else r[5] for r in bare],
            rtol=1e-6,
            err_msg=name,
        )
