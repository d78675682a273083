"""Eager capture through instance-level ``_call_impl`` overrides (``CallOverride``).

Where torch would call a module's ``forward`` without running any hook, a forward hook of ours
would push every call onto torch's slow path; the override keeps the fast path. These tests pin
what must not change with it: which calls are captured (calls through ``module(...)``, not
direct ``forward`` calls), which output is recorded (the one the call returned), what removal
and copies leave behind, and the cases that keep forward hooks (``DataParallel``, modules with
their own ``__call__``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    MemorySink,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_core.capture.hooks import CallHook, CallOverride

# the module, which ``torch.nn.parallel`` shadows with its function of the same name
replicate_module = importlib.import_module("torch.nn.parallel.replicate")


def _means(table: pa.Table, sample: int, signal: str = "output") -> dict[tuple[str, int], float]:
    rows = table.to_pylist()
    return {
        (r["layer"], r["call_index"]): r["value"]
        for r in rows
        if r["sample_id"] == sample and r["signal"] == signal and r["metric"] == "mean"
    }


def _overrides(model: nn.Module) -> list[str]:
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m.__dict__.get("_call_impl"), CallOverride)
    ]


def _call_hooks(model: nn.Module) -> list[str]:
    return [
        name
        for name, m in model.named_modules()
        if any(isinstance(h, CallHook) for h in m._forward_hooks.values())
    ]


def test_eager_capture_installs_call_overrides_and_removal_takes_them_all() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(2))
    x = torch.randn(3, 4)
    model(x).sum().backward()  # sampled: capture installed, and kept while sampling
    assert _overrides(model) == ["0", "1", "2"]
    assert _call_hooks(model) == []
    assert all(not m._forward_hooks for m in model[:])  # torch keeps its fast call path
    model(x)  # unsampled: capture removed
    assert _overrides(model) == []
    model(x).sum().backward()
    remove_observer(model)
    assert all("_call_impl" not in m.__dict__ and not m._forward_hooks for m in model.modules())
    # what was recorded is what each call returned
    h0 = model[0](x)
    expected = {
        ("0", 0): h0,
        ("1", 0): torch.relu(h0),
        ("2", 0): model(x),
    }
    got = _means(sink.table(), 1)
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert got[key] == pytest.approx(float(tensor.double().mean()), abs=1e-6)


class _Direct(nn.Module):
    """Calls ``inner.forward`` directly (hooks never see that) and ``outer`` through its call."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner.forward(x)) + self.outer(x)


def test_direct_forward_calls_are_not_captured() -> None:
    model = nn.Sequential(_Direct(), nn.Tanh())
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    for sample in (0, 1):
        for signal in ("output", "output_gradient"):
            assert sorted(_means(sink.table(), sample, signal)) == [
                ("0.outer", 0),
                ("0.outer", 1),
                ("1", 0),
            ]


def test_the_output_recorded_is_the_one_the_call_returned() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].register_forward_hook(lambda m, a, out: out * 2)  # before attaching
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    x = torch.randn(5, 4)
    model(x)
    # a hook added while capture is installed applies too: the value is what model[0](x) gives
    model[1].register_forward_hook(lambda m, a, out: out + 100)
    model(x)
    remove_observer(model)
    first = model[0].forward(x) * 2
    assert _means(sink.table(), 0)[("0", 0)] == pytest.approx(float(first.mean()), abs=1e-6)
    assert _means(sink.table(), 1)[("1", 0)] == pytest.approx(
        float(model[1].forward(first).mean()) + 100, abs=1e-4
    )
    # a module with a hook of its own keeps the override (torch runs the hook inside it)
    assert _means(sink.table(), 1)[("0", 0)] == _means(sink.table(), 0)[("0", 0)]


class _OwnCall(nn.Linear):
    """A module class with its own ``__call__``: torch's ``_call_impl`` may not be reached."""

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return super().__call__(*args, **kwargs)  # type: ignore[no-any-return]


def test_modules_with_their_own_call_get_a_forward_hook() -> None:
    model = nn.Sequential(_OwnCall(3, 3), nn.Linear(3, 3))
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    model(torch.randn(2, 3))
    assert _overrides(model) == ["1"]
    assert _call_hooks(model) == ["0"]
    remove_observer(model)
    assert sorted(_means(sink.table(), 0)) == [("0", 0), ("1", 0)]


def test_a_model_holding_data_parallel_is_captured_with_forward_hooks() -> None:
    model = nn.Sequential(
        nn.DataParallel(nn.Sequential(nn.Linear(3, 3), nn.ReLU())), nn.Linear(3, 1)
    )
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    model(torch.randn(2, 3))
    assert _overrides(model) == []
    assert _call_hooks(model)
    remove_observer(model)
    assert ("1", 0) in _means(sink.table(), 0)


def _cpu_replicas(
    monkeypatch: pytest.MonkeyPatch, network: nn.Module, scales: Sequence[float]
) -> list[nn.Module]:
    """``torch.nn.parallel.replicate`` on the CPU: replica ``j``'s parameters are the originals
    times ``scales[j]`` (a real replicate broadcasts them to device ``j``)."""

    def broadcast(
        tensors: Sequence[torch.Tensor], devices: Sequence[int], detach: bool = False
    ) -> list[list[torch.Tensor]]:
        return [[t.detach() * scale for t in tensors] for scale in scales[: len(devices)]]

    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape", broadcast)
    return replicate_module.replicate(network, list(range(len(scales))))


def test_data_parallel_replicas_run_their_own_modules_and_are_captured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    x = torch.randn(4, 3)
    model(x)  # sample 0: overrides installed on the originals
    assert _overrides(model) == ["0", "1", "2"]
    replicas = _cpu_replicas(monkeypatch, model, [2.0, 3.0])
    for k, replica in enumerate(replicas):
        out = replica(x)  # sample 1 + k
        scale = (2.0, 3.0)[k]
        h = torch.tanh(x @ (model[0].weight * scale).T + model[0].bias * scale)
        expected = h @ (model[2].weight * scale).T + model[2].bias * scale
        torch.testing.assert_close(out, expected)  # the replica's parameters, not the originals'
        got = _means(sink.table(), 1 + k)
        assert got[("0", 0)] == pytest.approx(float(h.atanh().mean()), abs=1e-5)
        assert got[("2", 0)] == pytest.approx(float(expected.mean()), abs=1e-5)
    # from the first replica on, capture is by forward hooks, shared with the replicas
    assert _overrides(model) == []
    assert _call_hooks(model) == ["0", "1", "2"]
    assert all(
        not isinstance(m.__dict__.get("_call_impl"), CallOverride)
        for r in replicas
        for m in r.modules()
    )
    model(x)
    assert _overrides(model) == []
    observer = observer_of(model)
    assert observer is not None
    remove_observer(model)
    assert np.isfinite(sink.table().column("value").to_numpy(zero_copy_only=False)).any()
