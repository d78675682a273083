"""The stability metrics (``rms``, ``kurtosis``, ``max_abs``: ``ti_schema.stability``) held to
a numpy float64 reference on both engines (the numpy one for CPU tensors; the torch one, which
accelerators use, run on CPU), on batched small tensors and one-pass large ones, with
non-finite entries, constant and empty tensors; through ``inject_observer(metrics=...)`` in
eager and compiled models."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _core_helpers import stats
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, observe
from ti_core.reduction import ReductionPlan, default_reducers
from ti_core.reduction.stability import with_metrics
from ti_schema import DEFAULT_METRICS, STABILITY_METRICS
from ti_schema.stability import KURTOSIS

CHOSEN = (*DEFAULT_METRICS, *STABILITY_METRICS)


def stability_reference(values: np.ndarray) -> dict[str, float | None]:
    """rms, excess kurtosis (population moments) and max |x| of the finite entries, float64."""
    a = np.asarray(values, dtype=np.float64).ravel()
    f = a[np.isfinite(a)]
    if not f.size:
        return dict.fromkeys(STABILITY_METRICS)
    d = f - f.mean()
    m2, m4 = (d**2).mean(), (d**4).mean()
    return {
        "rms": float(np.sqrt((f * f).mean())),
        "kurtosis": float(m4 / m2**2 - 3) if m2 > 0 else None,
        "max_abs": float(np.abs(f).max()),
    }


def tensors() -> list[torch.Tensor]:
    gen = np.random.default_rng(5)
    heavy = gen.standard_t(3, size=200_000).astype(np.float32)  # heavy tails: kurtosis >> 0
    dirty = gen.normal(1.0, 3.0, size=150_002).astype(np.float32)
    dirty[gen.integers(0, dirty.size, 40)] = np.nan
    dirty[gen.integers(0, dirty.size, 4)] = np.inf
    small = [torch.from_numpy(gen.normal(s, 1 + s, size=(4, 7))) for s in range(5)]
    small[1][0, 0] = float("nan")
    small[2][1, 1] = float("-inf")
    return [
        *small,
        torch.full((3, 3), 2.5),  # constant: kurtosis undefined
        torch.tensor([float("nan"), float("inf")]),  # no finite entries
        torch.from_numpy(gen.normal(0, 1, size=64)).to(torch.bfloat16),
        torch.from_numpy(heavy),
        torch.from_numpy(dirty),
    ]


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_both_engines_equal_the_float64_reference(
    engine: str, request: pytest.FixtureRequest
) -> None:
    if engine == "torch":
        request.getfixturevalue("torch_engine")
    plan = ReductionPlan(with_metrics(default_reducers(), CHOSEN))
    assert plan.metric_names == CHOSEN
    batch = tensors()
    got = plan.reduce(batch)
    assert not got.errors
    for i, tensor in enumerate(batch):
        want = stability_reference(tensor.double().numpy())
        for name in STABILITY_METRICS:
            j = CHOSEN.index(name)
            if want[name] is None:
                assert not got.available[i, j], (i, name)
                finite = np.isfinite(tensor.double().numpy()).any()
                reason = KURTOSIS.null_reason if finite else "no finite entries"
                assert got.reasons[i][j] == reason, (i, name)
            else:
                assert got.available[i, j], (i, name, got.reasons[i][j])
                tol = 1e-12 if name != "kurtosis" else 1e-9
                assert got.values[i, j] == pytest.approx(want[name], rel=tol), (i, name)
    heavy = CHOSEN.index("kurtosis")
    assert got.values[-2, heavy] > 3  # Student's t with 3 degrees of freedom


def test_metrics_are_checked_at_attach() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['skew'\]"):
        inject_observer(model, output_dir=None, sink=MemorySink(), metrics=("mean", "skew"))
    with pytest.raises(ValueError, match=r"must keep .* missing \['std'\]"):
        inject_observer(model, output_dir=None, sink=MemorySink(), metrics=("mean", "min", "max"))
    with pytest.raises(TypeError, match="metrics= must be a collection of metric names"):
        inject_observer(model, output_dir=None, sink=MemorySink(), metrics="rms")


def _check_outputs(table: Any, expected: dict[str, np.ndarray]) -> None:
    assert set(table.column("metric").to_pylist()) == set(CHOSEN)
    for layer, values in expected.items():
        want = stability_reference(values)
        got = stats(table, layer=layer, signal="output")
        for name in STABILITY_METRICS:
            assert got[name] == pytest.approx(want[name], rel=1e-6), (layer, name)


def test_observed_model_records_the_chosen_metrics_on_every_signal() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    sink = MemorySink()
    signals: Any = ("output", "output_gradient", "parameter", "parameter_gradient")
    with observe(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), metrics=CHOSEN, signals=signals
    ):
        model(x).pow(2).mean().backward()
    table = sink.table()
    assert set(table.column("signal").to_pylist()) == set(signals)
    with torch.no_grad():
        h0 = model[0](x)
        expected = {"0": h0.numpy(), "1": model[1](h0).numpy()}
    _check_outputs(table, expected)
    got = stats(table, layer="0", signal="parameter_gradient", tensor_path="weight")
    want = stability_reference(model[0].weight.grad.numpy())
    for name in STABILITY_METRICS:
        assert got[name] == pytest.approx(want[name], rel=1e-6)


def test_compiled_model_records_the_chosen_metrics() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler(), metrics=CHOSEN)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).sum().backward()
    from ti_core import remove_observer

    remove_observer(model)
    with torch.no_grad():
        h0 = model[0](x)
        expected = {"0": h0.numpy(), "1": model[1](h0).numpy(), "2": model(x).numpy()}
    _check_outputs(sink.table(), expected)
