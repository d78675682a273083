"""Error policy: telemetry failures keep training running and every measurement that succeeded."""

from __future__ import annotations

import warnings

import pyarrow as pa
import pytest
import torch
from _core_helpers import rows
from torch import nn

from ti_core import (
    AlwaysSampler,
    MemorySink,
    TelemetryWarning,
    default_reducers,
    inject_observer,
    observe,
    remove_observer,
)
from ti_core.reducers import Reducer


def exploding(t: torch.Tensor) -> torch.Tensor:
    raise ArithmeticError("reducer exploded")


REDUCERS = [
    *default_reducers(),
    Reducer("abs_max", lambda t: t.abs().max()),
    Reducer("boom", exploding),
]


def test_warn_keeps_other_metrics_and_records_the_reason() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    sink = MemorySink()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler(), reducers=REDUCERS):
            for _ in range(3):
                model(torch.randn(2, 3)).sum().backward()
    assert any("reducer exploded" in str(w.message) for w in record)
    assert (
        len([w for w in record if issubclass(w.category, TelemetryWarning)]) == 1
    )  # once per kind
    table = sink.table()
    boom = rows(table, metric="boom")
    assert len(boom) == 3 * 2 * 2  # samples x layers x signals: a null row, not a missing one
    assert all(r["value"] is None and "reducer exploded" in r["unavailable_reason"] for r in boom)
    abs_max = rows(table, metric="abs_max", layer="0", signal="output", sample_id=0)[0]
    maximum = rows(table, metric="max", layer="0", signal="output", sample_id=0)[0]
    minimum = rows(table, metric="min", layer="0", signal="output", sample_id=0)[0]
    assert abs_max["value"] == pytest.approx(max(abs(maximum["value"]), abs(minimum["value"])))


def test_ignore_is_silent() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    sink = MemorySink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with observe(
            model,
            output_dir=None,
            sink=sink,
            sampler=AlwaysSampler(),
            reducers=REDUCERS,
            error_policy="ignore",
        ):
            model(torch.randn(2, 3)).sum().backward()
    assert rows(sink.table(), metric="boom")


def test_raise_propagates_from_forward_and_backward() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model,
        output_dir=None,
        sink=MemorySink(),
        sampler=AlwaysSampler(),
        reducers=REDUCERS,
        error_policy="raise",
    )
    with pytest.raises(ArithmeticError, match="reducer exploded"):
        model(torch.randn(2, 3))
    remove_observer(model)
    assert not model._forward_hooks
    assert not model._forward_pre_hooks


class BrokenSink(MemorySink):
    def write_history(self, batch: pa.RecordBatch) -> None:
        raise OSError("disk full")


def test_failing_sink_does_not_stop_training_or_other_sinks() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    good, broken = MemorySink(), BrokenSink()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with observe(model, output_dir=None, sink=[broken, good], sampler=AlwaysSampler()):
            for _ in range(2):
                model(torch.randn(2, 3)).sum().backward()
    telemetry = [w for w in record if issubclass(w.category, TelemetryWarning)]
    assert len(telemetry) == 1
    assert "disk full" in str(telemetry[0].message)
    assert len({r["sample_id"] for r in rows(good.table())}) == 2
    assert broken.close_count == 1
    assert good.close_count == 1


def test_failing_sink_under_raise() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model, output_dir=None, sink=BrokenSink(), sampler=AlwaysSampler(), error_policy="raise"
    )
    with pytest.raises(OSError, match="disk full"):
        model(torch.randn(2, 3))
    remove_observer(model)


class GradientSinkFailure(MemorySink):
    def write_history(self, batch: pa.RecordBatch) -> None:
        if batch.column("signal")[0].as_py() == "output_gradient":
            raise OSError("gradient write failed")
        super().write_history(batch)


def test_raise_propagates_from_backward() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    sink = GradientSinkFailure()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), error_policy="raise"
    )
    out = model(torch.randn(2, 3))
    with pytest.raises(OSError, match="gradient write failed"):
        out.sum().backward()
    remove_observer(model)
    assert rows(sink.table(), signal="output")
    assert not model._forward_hooks
