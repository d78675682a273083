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

    def needs_4d(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"channels": tensor.mean(dim=(0, 2, 3))[0]}

    with pytest.raises(TypeError, match="probe tensor"):
        inject_observer(model, output_dir=None, sink=MemorySink(), reducers=[needs_4d])
    assert observer_of(model) is None


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
        assert types.__name__ == "ti_core.legacy"
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
