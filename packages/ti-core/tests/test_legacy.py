"""torchinstruments 0.8.0 reducers and sinks, written as 0.8.0 documents them, keep working.

0.8.0's reducer protocol: ``__call__(tensor) -> dict[str, bool | float | int | Tensor]``, optionally
``reducer_type()`` / ``reducer_settings()``. Its sink protocol: ``initialize(run, modules)``,
``observe(sample)``, ``close()``. The code below uses nothing from ti-core but what the
predecessor's user code used (the record types are duck-typed, as a 0.8.0 sink reads them).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ti_core import (
    AlwaysSampler,
    MemorySink,
    TelemetryWarning,
    default_reducers,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_core.legacy import legacy_path, record_types

# --- written as for torchinstruments 0.8.0 ------------------------------------------------------


def l1_and_positive(tensor: torch.Tensor) -> dict[str, torch.Tensor | float]:
    """A 0.8.0 reducer: several named metrics from one call, tensors and floats mixed."""
    calls.append(tuple(tensor.shape))
    return {"l1": tensor.abs().sum(), "positive_fraction": float((tensor > 0).float().mean())}


calls: list[tuple[int, ...]] = []


class MaxAbs:
    """A described 0.8.0 reducer (reducer_type/reducer_settings, as 0.8.0's built-ins)."""

    def __call__(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"max_abs": tensor.abs().max()}

    def reducer_type(self) -> str:
        return "max_abs"

    def reducer_settings(self) -> dict[str, Any]:
        return {"metrics": ("max_abs",)}


class CollectingSink:
    """A 0.8.0 sink: keeps the run, the module catalog and every sample record."""

    def __init__(self) -> None:
        self.run: Any = None
        self.modules: dict[str, Any] = {}
        self.samples: list[Any] = []
        self.closed = 0

    def initialize(self, run: Any, modules: dict[str, Any]) -> None:
        self.run = run
        self.modules = modules

    def observe(self, sample: Any) -> None:
        self.samples.append(sample)

    def close(self) -> None:
        self.closed += 1


def observations(sample: Any) -> list[tuple[Any, ...]]:
    """0.8.0's own flattening of a sample (torchinstruments.history.records.observations)."""
    forward = sample.state == "forward_complete"
    signal = "output" if forward else "output_gradient"
    found = []
    for name, module_calls in sample.modules.items():
        for call in module_calls:
            tensors = call.outputs if forward else call.output_gradients
            for path, tensor in tensors.items():
                values: dict[str, Any] = dict(tensor.stats)
                values.update((m, None) for m in tensor.unavailable_stats)
                for metric, value in values.items():
                    found.append(
                        (name, call.call_index, signal, path, sample.sample_id, metric, value)
                    )
    return found


# ------------------------------------------------------------------------------------------------


class Split(nn.Module):
    """A leaf module with a nested output: {'main': ..., 'aux': (..., ...)}."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"main": x * 2, "aux": (x, x + 1)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.split = Split()
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.split(self.lin(x))
        result: torch.Tensor = self.head(out["main"] + out["aux"][1])
        return result


def test_a_0_8_0_reducer_is_adapted_with_one_warning_and_exact_values() -> None:
    calls.clear()
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    sink = MemorySink()
    with pytest.warns(FutureWarning) as caught:
        inject_observer(
            model,
            output_dir=None,
            sink=sink,
            sampler=AlwaysSampler(),
            reducers=[*default_reducers(), l1_and_positive, MaxAbs()],
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(messages) == 2  # one per 0.8.0 reducer, naming the new form
    assert "Reducer('l1', fn)" in messages[0]
    assert "Reducer('max_abs', fn)" in messages[1]
    assert caught[0].filename == __file__  # points at the inject_observer call
    probe_calls = len(calls)
    captured: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_hook(lambda m, i, o, n=n: captured.__setitem__(n, o.detach().clone()))
        for n, m in model.named_children()
    ]
    x = torch.randn(3, 5)
    model(x).sum().backward()
    remove_observer(model)
    for h in handles:
        h.remove()
    table = sink.table().to_pylist()
    assert sink.run is not None
    assert sink.run.metrics[-3:] == ("l1", "positive_fraction", "max_abs")
    outputs = [r for r in table if r["signal"] == "output"]
    for name, tensor in captured.items():
        got = {r["metric"]: r["value"] for r in outputs if r["layer"] == name}
        values = tensor.numpy().astype(np.float64)
        assert got["l1"] == pytest.approx(np.abs(values).sum(), rel=1e-5)
        assert got["positive_fraction"] == pytest.approx(np.mean(values > 0), rel=1e-6)
        assert got["max_abs"] == pytest.approx(np.abs(values).max(), rel=1e-6)
    # one call per measured tensor (outputs and gradients), not one per metric
    measured = {(r["layer"], r["signal"]) for r in table}
    assert len(calls) - probe_calls == len(measured) == 6


def test_a_0_8_0_reducer_that_changes_its_metric_names_reports_it() -> None:
    def shifty(tensor: torch.Tensor) -> dict[str, float]:
        if tensor.dim() == 2 and tensor.shape[0] == 4:  # the probe, at inject_observer
            return {"a": 1.0, "b": 2.0}
        return {"a": 1.0, "c": 3.0}

    model = nn.Sequential(nn.Linear(2, 2))
    sink = MemorySink()
    with pytest.warns(FutureWarning):
        inject_observer(
            model, output_dir=None, sink=sink, sampler=AlwaysSampler(), reducers=[shifty]
        )
    with pytest.warns(TelemetryWarning) as caught:
        model(torch.randn(1, 2))
    reported = " ".join(str(w.message) for w in caught)
    assert "did not return at inject_observer" in reported
    assert "returned no 'b'" in reported
    remove_observer(model)
    by_metric = {r["metric"]: r for r in sink.table().to_pylist()}
    assert by_metric["a"]["value"] is None  # the first metric carries the report
    assert "['c']" in by_metric["a"]["unavailable_reason"]
    assert by_metric["b"]["value"] is None
    assert "returned no 'b'" in by_metric["b"]["unavailable_reason"]


def test_a_callable_that_is_no_0_8_0_reducer_is_refused_naming_the_new_form() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"not a dict of metric names.*Reducer\('name', fn\)"):
        inject_observer(model, output_dir=None, sink=MemorySink(), reducers=[lambda t: t.sum()])

    assert observer_of(model) is None


def _observed_with_legacy(model: nn.Module, reducers: list[Any], **kwargs: Any) -> MemorySink:
    """``model`` observed every forward into a MemorySink with ``reducers`` (0.8.0 ones among
    them: one FutureWarning, checked)."""
    sink = MemorySink()
    with pytest.warns(FutureWarning):
        inject_observer(
            model, output_dir=None, sink=sink, sampler=AlwaysSampler(), reducers=reducers, **kwargs
        )
    return sink


def test_a_0_8_0_reducer_for_convolution_maps_learns_its_names_from_a_4d_probe() -> None:
    def first_channel_mean(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"channel0_mean": tensor.mean(dim=(0, 2, 3))[0]}  # needs (N, C, H, W)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU())
    sink = _observed_with_legacy(model, [first_channel_mean])
    x = torch.randn(2, 2, 6, 6)
    with torch.no_grad():
        want = model[0](x)[:, 0].double().mean().item()
    model(x)
    remove_observer(model)
    got = [
        r["value"]
        for r in sink.table().to_pylist()
        if r["layer"] == "0" and r["metric"] == "channel0_mean"
    ]
    assert got == [pytest.approx(want, rel=1e-5)]


def _always_broken(tensor: torch.Tensor) -> dict[str, float]:
    raise RuntimeError("needs the model's own tensors")


@pytest.mark.parametrize("policy", ["warn", "ignore", "raise"])
def test_a_0_8_0_reducer_that_raises_attaches_and_fails_at_the_forward_by_policy(
    policy: str,
) -> None:
    """As 0.8.0 did: attach under every policy; at the forward "warn" warns once, "ignore"
    stays silent (the metric's rows unavailable, the reducer's error as the reason), "raise"
    raises the reducer's own error from that forward. (index.md: tests/test_io_e2e.py.)"""
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    sink = _observed_with_legacy(model, [*default_reducers(), _always_broken], error_policy=policy)
    assert sink.run is not None
    assert sink.run.metrics[-1] == "_always_broken"
    note = sink.run.settings["reducers[1]"]
    assert "_always_broken raised on every probe tensor" in note
    assert "RuntimeError: needs the model's own tensors" in note
    x = torch.randn(3, 2)

    def train() -> None:
        for _ in range(3):  # reduction may run behind the forward: raised by a next one
            model(x).sum().backward()

    if policy == "raise":
        with pytest.raises(RuntimeError, match="needs the model's own tensors"):
            train()
        remove_observer(model)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train()
        remove_observer(model)
    telemetry = [w for w in caught if issubclass(w.category, TelemetryWarning)]
    assert len(telemetry) == (1 if policy == "warn" else 0)
    if telemetry:
        assert "needs the model's own tensors" in str(telemetry[0].message)
    table = sink.table().to_pylist()
    broken = [r for r in table if r["metric"] == "_always_broken"]
    assert len(broken) == 3 * 2 * 2  # every sampled tensor, outputs and gradients
    assert all(r["value"] is None for r in broken)
    assert {r["unavailable_reason"] for r in broken} == {
        "RuntimeError: needs the model's own tensors"
    }
    assert all(r["value"] is not None for r in table if r["metric"] == "mean")


def test_a_0_8_0_reducer_that_fails_only_on_the_probes_says_why_its_metrics_are_missing() -> None:
    def wide_only(tensor: torch.Tensor) -> dict[str, float]:
        if tensor.shape[-1] != 5:
            raise ValueError("expects 5 features")
        return {"f0": float(tensor[..., 0].mean())}

    model = nn.Sequential(nn.Linear(3, 5))
    sink = _observed_with_legacy(model, [wide_only])
    assert sink.run is not None
    assert sink.run.metrics == ("wide_only",)
    assert "ValueError: expects 5 features" in sink.run.settings["reducers[0]"]
    with pytest.warns(TelemetryWarning):
        model(torch.randn(2, 3))
    remove_observer(model)
    (row,) = [r for r in sink.table().to_pylist() if r["signal"] == "output"]
    assert row["value"] is None
    assert "returned metrics ['f0']" in row["unavailable_reason"]
    assert "raised on every probe tensor" in row["unavailable_reason"]


def test_a_0_8_0_sink_receives_0_8_0_records() -> None:
    torch.manual_seed(1)
    model = Net()
    legacy, memory = CollectingSink(), MemorySink()
    with pytest.warns(FutureWarning, match=r"implement ti_core\.Sink") as caught:
        inject_observer(
            model,
            output_dir=None,
            sink=[legacy, memory],
            sampler=AlwaysSampler(),
            selector=lambda name, module: name in ("lin", "split", "head"),
            histogram_selector=["lin"],
        )
    assert caught[0].filename == __file__
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    with torch.no_grad():
        model.eval()
        model(torch.randn(2, 4))  # a sample without backward
    remove_observer(model)

    assert legacy.closed == 1
    assert legacy.run.schema_version == 6
    assert legacy.run.sampling.type == "always"
    assert legacy.run.collection.histogram_modules == ("lin",)
    assert list(legacy.modules) == ["lin", "split", "head"]
    lin = legacy.modules["lin"]
    assert (lin.type, lin.aliases, lin.parameter_count) == ("Linear", ("lin",), 4 * 3 + 3)
    assert legacy.modules["split"].parameter_count == 0

    states = [(s.sample_id, str(s.state)) for s in legacy.samples]
    assert states == [
        (0, "forward_complete"),
        (0, "backward_observed"),
        (1, "forward_complete"),
        (1, "backward_observed"),
        (2, "forward_complete"),
    ]
    split_paths = sorted(legacy.samples[0].modules["split"][0].outputs)
    assert split_paths == ["output.aux.0", "output.aux.1", "output.main"]
    backward = legacy.samples[1]
    assert sorted(backward.modules["split"][0].output_gradients) == [
        "grad_output.aux.0",
        "grad_output.aux.1",
        "grad_output.main",
    ]
    assert backward.modules["lin"][0].outputs  # 0.8.0's backward record keeps the outputs
    assert backward.timestamp == legacy.samples[0].timestamp  # the forward's time

    # Every measurement the MemorySink got reached the 0.8.0 sink, with 0.8.0's paths.
    seen = {obs[:6]: obs[6] for sample in legacy.samples for obs in observations(sample)}
    rows = memory.table().to_pylist()
    assert len(seen) == len(rows)
    for r in rows:
        path = legacy_path(r["tensor_path"], gradient=r["signal"] == "output_gradient")
        key = (r["layer"], r["call_index"], r["signal"], path, r["sample_id"], r["metric"])
        assert seen[key] == r["value"], key

    # Histograms of the focus layer, as 0.8.0's HistogramRecord.
    hist = legacy.samples[0].modules["lin"][0].outputs["output"].histograms["distribution"]
    expected = next(
        h
        for h in memory.histograms().to_pylist()
        if (h["layer"], h["signal"], h["sample_id"]) == ("lin", "output", 0)
    )
    assert hist.bin_counts == tuple(expected["bucket_counts"])
    assert hist.bin_edges[1:] == tuple(expected["bucket_limits"])
    assert hist.bin_edges[0] == hist.minimum == expected["min"]
    assert sum(hist.bin_counts) == hist.finite_count == 9
    assert not legacy.samples[0].modules["head"][0].outputs["output"].histograms


def test_a_failing_0_8_0_sink_goes_through_the_error_policy() -> None:
    class Broken(CollectingSink):
        def observe(self, sample: Any) -> None:
            raise RuntimeError("disk on fire")

    model = nn.Sequential(nn.Linear(2, 2))
    memory = MemorySink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        inject_observer(model, output_dir=None, sink=[Broken(), memory], sampler=AlwaysSampler())
    with pytest.warns(Warning, match="disk on fire"):
        model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    assert memory.table().num_rows > 0  # the other sink lost nothing


@pytest.mark.parametrize(
    ("path", "gradient", "old"),
    [
        ("", False, "output"),
        ("", True, "grad_output"),
        ("[0]", False, "output.0"),
        ("['aux'][0]", False, "output.aux.0"),
        ("['aux'][0]", True, "grad_output.aux.0"),
        ('["a]b"]', False, "output.a]b"),
        (".logits", False, "output.logits"),
        ("[1]['h'].state", False, "output.1.h.state"),
    ],
)
def test_tensor_paths_are_spelled_as_0_8_0(path: str, gradient: bool, old: str) -> None:
    assert legacy_path(path, gradient=gradient) == old


def test_record_types_are_torchinstruments_own_when_installed() -> None:
    types = record_types()
    try:
        import torchinstruments.records as installed
    except ImportError:
        assert types.__name__ == "ti_core.legacy.records"
    else:
        assert types is installed


def test_a_0_8_0_sink_receives_only_the_signals_0_8_0_had() -> None:
    """With the parameter signals on, the MemorySink gets their rows; the 0.8.0 sink, which
    has no place for them, gets exactly the outputs and output gradients, as before."""
    model = Net()
    legacy, memory = CollectingSink(), MemorySink()
    with pytest.warns(FutureWarning, match=r"implement ti_core\.Sink"):
        inject_observer(
            model,
            output_dir=None,
            sink=[legacy, memory],
            sampler=AlwaysSampler(),
            signals=("output", "output_gradient", "parameter", "parameter_gradient"),
            histogram_selector=["lin"],
        )
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    rows = memory.table().to_pylist()
    assert {r["signal"] for r in rows} == {
        "output",
        "output_gradient",
        "parameter",
        "parameter_gradient",
    }
    assert [str(s.state) for s in legacy.samples] == ["forward_complete", "backward_observed"]
    seen = {obs[:6] for sample in legacy.samples for obs in observations(sample)}
    kept = [r for r in rows if r["signal"] in ("output", "output_gradient")]
    assert len(seen) == len(kept)
    paths = {obs[3] for obs in seen}
    assert not any("weight" in p or "bias" in p for p in paths)
