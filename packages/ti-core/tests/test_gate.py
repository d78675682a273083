"""The gate's documented states on a real model, the public accessor, and the one place that
reads sink capabilities (ti-schema's declarations)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pyarrow as pa
import pytest
import torch
from torch import nn

from ti_core import (
    EveryNForwardsSampler,
    MemorySink,
    RunInfo,
    SinkCapabilities,
    has_observer,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_core.emission.sinks import read_capabilities
from ti_core.gate import GateState


def _hook_counts(model: nn.Module) -> tuple[int, int]:
    """(hooks on the root, forward hooks and call overrides on every other module)."""
    root = len(model._forward_pre_hooks) + len(model._forward_hooks)
    others = sum(
        len(m._forward_hooks) + ("_call_impl" in m.__dict__)
        for m in model.modules()
        if m is not model
    )
    return root, others


def test_state_follows_sampled_and_unsampled_root_forwards() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    assert observer_of(model) is None
    inject_observer(model, output_dir=None, sink=MemorySink(), sampler=EveryNForwardsSampler(2))
    observer = observer_of(model)
    assert observer is not None
    assert has_observer(model)
    x = torch.randn(2, 3)

    assert observer.state is GateState.IDLE  # attached: the two root hooks only
    assert _hook_counts(model) == (2, 0)
    model(x).sum().backward()  # forward 0: sampled
    assert observer.state is GateState.CAPTURING
    assert _hook_counts(model) == (2, 3)  # one per selected module
    assert observer.gate.in_flight == 0
    model(x).sum().backward()  # forward 1: unsampled, nothing in flight: capture removed
    assert observer.state is GateState.IDLE
    assert _hook_counts(model) == (2, 0)

    held = model(x)  # forward 2: sampled; its output kept for a later backward
    assert observer.state is GateState.CAPTURING
    remove_observer(model)
    assert observer.state is GateState.CLOSED
    assert observer.closed
    assert _hook_counts(model) == (0, 0)
    assert observer_of(model) is None
    rows = observer.sinks.sinks[0]
    assert isinstance(rows, MemorySink)
    before = rows.table().num_rows
    held.sum().backward()  # a gradient arriving after removal is dropped, not written
    assert rows.table().num_rows == before


def test_state_changes_at_the_root_boundary_before_the_forward_body() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.seen: list[tuple[GateState, int]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            observer = observer_of(self)
            assert observer is not None
            self.seen.append((observer.state, observer.gate.in_flight))
            return self.inner(x)

    model = Root()
    inject_observer(model, output_dir=None, sink=MemorySink(), sampler=EveryNForwardsSampler(2))
    try:
        for _ in range(3):
            model(torch.randn(1, 3))
    finally:
        remove_observer(model)
    assert model.seen == [
        (GateState.CAPTURING, 1),  # forward 0: sampled, its sample in flight
        (GateState.IDLE, 0),  # forward 1: unsampled, capture removed before the body ran
        (GateState.CAPTURING, 1),  # forward 2: sampled again
    ]


def test_copies_have_no_observer() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    inject_observer(model, output_dir=None, sink=MemorySink(), sampler=EveryNForwardsSampler(1))
    try:
        clone = copy.deepcopy(model)
        assert observer_of(clone) is None
        assert not has_observer(clone)
        assert observer_of(model) is not None
    finally:
        remove_observer(model)


class _PlainSink:
    def open(self, run: RunInfo) -> None: ...

    def write_history(self, batch: pa.RecordBatch) -> None: ...

    def write_histograms(self, batch: pa.RecordBatch) -> None: ...

    def close(self) -> None: ...


class _DeclaringSink(_PlainSink):
    def __init__(self) -> None:
        self.barriers: list[Callable[[], None]] = []
        self.writers: list[threading.Thread] = []

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(background_writes=True, on_barrier=self.barriers.append)

    def write_history(self, batch: pa.RecordBatch) -> None:
        self.writers.append(threading.current_thread())


class _UndeclaredSink(_PlainSink):
    """The 0.1 attribute spelling, no ``capabilities()``: nothing is probed, so a plain sink."""

    accepts_background_writes = True

    def attach_barrier(self, barrier: Callable[[], None]) -> None:
        raise AssertionError("attach_barrier is not probed")


def test_read_capabilities_reads_each_declaration_and_probes_nothing() -> None:
    declaring = _DeclaringSink()
    plain, undeclared, declared = read_capabilities([_PlainSink(), _UndeclaredSink(), declaring])
    assert plain == undeclared == SinkCapabilities()
    assert declared.background_writes is True
    assert declared.on_barrier == declaring.barriers.append


@pytest.mark.usefixtures("every_signal_queued")
@pytest.mark.parametrize("background", [True, False])
def test_the_worker_is_used_only_when_every_sink_declares_background_writes(
    background: bool,
) -> None:
    declaring = _DeclaringSink()
    sinks = [declaring] if background else [declaring, _PlainSink()]
    model = nn.Sequential(nn.Linear(2, 2))
    inject_observer(model, output_dir=None, sink=sinks, sampler=EveryNForwardsSampler(1))
    try:
        model(torch.randn(1, 2)).sum().backward()
        # the barrier goes to a declaring sink only when writes may be deferred
        assert len(declaring.barriers) == (1 if background else 0)
        if background:
            declaring.barriers[0]()  # waits for the queued signals
    finally:
        remove_observer(model)
    assert len(declaring.writers) == 2  # outputs, then gradients
    main = threading.current_thread()
    assert all((writer is not main) is background for writer in declaring.writers)
