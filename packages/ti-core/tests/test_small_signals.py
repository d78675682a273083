"""Small signals written at once while the emission worker is idle (``INLINE_SIGNAL_BYTES``).

A signal with little left to reduce is mostly Python work that holds the GIL on either thread;
handing it to the worker only adds a thread contending for the GIL. It is written on the thread
that ended it, unless the worker still holds earlier signals: the sinks' order never changes,
and neither do the rows.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
import torch
from test_emission import GatedSink, attached, recording
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, remove_observer
from ti_core.reduction import placement

RUN_COLUMNS = ["run_id", "timestamp"]


def _train(model: nn.Module, inputs: list[torch.Tensor]) -> None:
    for x in inputs:
        model(x).square().mean().backward()


def test_small_signals_are_written_on_the_thread_that_ended_them() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sink, observer = recording(model)
    _train(model, [torch.randn(4, 8) for _ in range(3)])
    assert sink.writers
    assert all(c is threading.main_thread() and e is None for c, e in sink.writers)
    assert observer.emission_thread is None  # the worker never started
    sink.observer = None
    remove_observer(model)
    assert len({r["sample_id"] for r in sink.table().to_pylist()}) == 3


def test_signals_above_the_bound_go_to_the_worker() -> None:
    # each output snapshot is 64 x 512 float32 = 128 KiB, over INLINE_SIGNAL_BYTES
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh())
    sink, observer = recording(model)
    _train(model, [torch.randn(64, 512) for _ in range(2)])
    observer.drain()
    assert sink.writers
    assert all(c is e and c is not threading.main_thread() for c, e in sink.writers)
    sink.observer = None
    remove_observer(model)


def test_a_small_signal_never_overtakes_queued_ones() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh())
    sink = GatedSink()  # the worker's writes wait until the gate opens
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    observer = attached(model)
    try:
        model(torch.randn(64, 512))  # sample 0: large, queued; its write waits at the gate
        with torch.no_grad():
            model(torch.randn(1, 512))  # sample 1: small, but the worker is busy: queued too
        assert sink.history_rows_written == 0  # nothing was written past the queued signal
        sink.gate.set()
        observer.drain()
        samples = [r["sample_id"] for r in sink.table().to_pylist()]
        assert samples == sorted(samples)
        assert set(samples) == {0, 1}
    finally:
        sink.gate.set()
        remove_observer(model)


def _table(monkeypatch: pytest.MonkeyPatch, inline_bytes: int) -> tuple[pa.Table, pa.Table]:
    monkeypatch.setattr(placement, "INLINE_SIGNAL_BYTES", inline_bytes)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 6), nn.Sigmoid(), nn.Linear(6, 1))
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        histogram_selector=["0"],
    )
    g = torch.Generator().manual_seed(4)
    _train(model, [torch.randn(5, 6, generator=g) for _ in range(4)])
    remove_observer(model)
    return sink.table().drop_columns(RUN_COLUMNS), sink.histograms().drop_columns(RUN_COLUMNS)


def test_rows_are_the_same_written_at_once_or_by_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    at_once = _table(monkeypatch, placement.INLINE_SIGNAL_BYTES)
    queued = _table(monkeypatch, -1)
    assert at_once[0].num_rows > 0
    assert at_once[1].num_rows > 0
    assert at_once[0].equals(queued[0])
    assert at_once[1].equals(queued[1])
