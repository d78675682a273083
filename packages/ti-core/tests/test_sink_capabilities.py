"""Sinks declare their capabilities (ti_schema.SinkCapabilities); the observer reads them.

Real models and training steps; the contract types are ti-schema's, re-exported unchanged.
"""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa
import pytest
import torch
from torch import nn

import ti_core
import ti_core.ranks
import ti_core.sink
import ti_schema
from ti_core import (
    AlwaysSampler,
    MemorySink,
    RunInfo,
    SinkCapabilities,
    has_observer,
    inject_observer,
    remove_observer,
)
from ti_schema import Barrier


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def train(model: nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        optimizer.step()


class BarrierRecordingSink(MemorySink):
    """A MemorySink noting each barrier it is handed and the threads that wrote to it."""

    def __init__(self) -> None:
        super().__init__()
        self.barriers: list[Barrier] = []
        self.writer_threads: set[int] = set()

    def attach_barrier(self, barrier: Barrier) -> None:
        self.barriers.append(barrier)
        super().attach_barrier(barrier)

    def write_history(self, batch: pa.RecordBatch) -> None:
        self.writer_threads.add(threading.get_ident())
        super().write_history(batch)


class DeclaringSink:
    """A user sink declaring only what it is given (no barrier)."""

    def __init__(self, capabilities: Any) -> None:
        self.declared = capabilities
        self.opened = 0
        self.rows = 0

    def capabilities(self) -> Any:
        return self.declared

    def open(self, run: RunInfo) -> None:
        self.opened += 1

    def write_history(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        pass

    def close(self) -> None:
        pass


def test_contract_types_are_ti_schemas_own() -> None:
    for name in ("Sink", "RunInfo", "LayerInfo", "SinkCapabilities", "RankPolicy", "RankSelection"):
        assert getattr(ti_core, name) is getattr(ti_schema, name), name
    for name in ("Sink", "RunInfo", "LayerInfo", "SinkCapabilities", "sink_capabilities"):
        assert getattr(ti_core.sink, name) is getattr(ti_schema, name), name
    assert ti_core.ranks.RankSelection is ti_schema.RankSelection
    assert ti_core.ranks.RankPolicy is ti_schema.RankPolicy
    assert ti_core.MemorySink().capabilities().background_writes


@pytest.mark.parametrize("declared", [{"background_writes": True}, True, None])
def test_a_malformed_declaration_is_refused_before_any_sink_opens(declared: Any) -> None:
    model = make_model()
    first, bad = MemorySink(), DeclaringSink(declared)
    with pytest.raises(TypeError, match=r"capabilities\(\) must return a ti_schema"):
        inject_observer(model, output_dir=None, sink=[first, bad], sampler=AlwaysSampler())
    assert (first.open_count, bad.opened) == (0, 0)
    assert not has_observer(model)


@pytest.mark.usefixtures("every_signal_queued")
def test_barrier_goes_to_the_sinks_that_ask_when_the_worker_writes() -> None:
    model = make_model()
    asking, silent = BarrierRecordingSink(), DeclaringSink(SinkCapabilities(background_writes=True))
    inject_observer(model, output_dir=None, sink=[asking, silent], sampler=AlwaysSampler())
    try:
        train(model, 3)
        assert len(asking.barriers) == 1
        asking.barriers[0]()  # returns once every ended signal is written
        rows = asking.table().num_rows
        assert rows == silent.rows > 0
        assert asking.writer_threads
        assert threading.get_ident() not in asking.writer_threads
    finally:
        remove_observer(model)


def test_no_worker_and_no_barrier_when_one_sink_does_not_declare_background_writes() -> None:
    model = make_model()
    asking, inline = BarrierRecordingSink(), DeclaringSink(SinkCapabilities())
    inject_observer(model, output_dir=None, sink=[asking, inline], sampler=AlwaysSampler())
    try:
        train(model, 2)
    finally:
        remove_observer(model)
    assert asking.barriers == []
    assert asking.writer_threads == {threading.get_ident()}
    assert asking.table().num_rows == inline.rows > 0
