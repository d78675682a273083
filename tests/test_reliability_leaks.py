"""Leaks: many sampled steps, including forwards that never get a backward, must not grow what
the process holds. Measured after a warm-up, over the following steps: Arrow's allocations
(``pyarrow.total_allocated_bytes``), Python allocations (``tracemalloc``) and live objects
(tensors, record batches, everything the garbage collector tracks), each with a tight bound.
``test_a_planted_leak_is_caught`` proves the bounds see a leak: an observer that keeps every
batch it emits fails them. (benchmarks/soak.py runs 20,000 steps and measures RSS.)"""

from __future__ import annotations

import gc
import tracemalloc
import warnings
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pytest
import torch
from torch import nn

from ti_core import AlwaysSampler, RunInfo, inject_observer, remove_observer
from ti_core.emission.sinks import SinkFanout
from ti_schema import DEFAULT_METRICS

WARMUP = 100
STEPS = 200
"""Measured steps after the warm-up (a sampled step of this model costs ~20 ms on CI, ~2x that
under tracemalloc)."""

ARROW_BOUND = 4 * 2**10
"""Arrow bytes the measured steps may add in total: measured 0; the planted leak adds ~19 KiB
per step."""
PYTHON_BOUND = 64 * 2**10
"""Python heap bytes (tracemalloc) the measured steps may add in total: measured ~2 KiB."""
OBJECTS_BOUND = STEPS // 2
"""gc-tracked objects the measured steps may add (measured: none; one leaked object every
second step breaks it)."""


class CountingSink:
    """A real sink that keeps only counts (what a MemorySink keeps would grow by design)."""

    def __init__(self) -> None:
        self.history_rows = 0
        self.histogram_rows = 0
        self.closed = 0

    def open(self, run: RunInfo) -> None:
        self.run = run

    def write_history(self, batch: pa.RecordBatch) -> None:
        self.history_rows += batch.num_rows

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        self.histogram_rows += batch.num_rows

    def close(self) -> None:
        self.closed += 1


@dataclass(frozen=True)
class Snapshot:
    arrow: int
    python: int
    objects: Counter[str]


def _snapshot() -> Snapshot:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module proxies
        warnings.simplefilter("ignore", FutureWarning)
        kinds: Counter[str] = Counter()
        for o in gc.get_objects():
            kinds["all"] += 1
            if isinstance(o, torch.Tensor):
                kinds["tensors"] += 1
            elif isinstance(o, pa.RecordBatch | pa.Table | pa.Array):
                kinds["arrow"] += 1
    return Snapshot(pa.total_allocated_bytes(), tracemalloc.get_traced_memory()[0], kinds)


@dataclass(frozen=True)
class Growth:
    arrow_bytes: int
    python_bytes: int
    objects: dict[str, int]
    history_rows: int

    def problems(self) -> list[str]:
        """Every bound the measured steps broke (empty: no leak seen)."""
        found = []
        if self.arrow_bytes > ARROW_BOUND:
            found.append(f"Arrow allocations grew {self.arrow_bytes} B")
        if self.python_bytes > PYTHON_BOUND:
            found.append(f"Python allocations grew {self.python_bytes} B")
        if self.objects["all"] > OBJECTS_BOUND:
            found.append(f"{self.objects['all']} more live objects")
        if self.objects["tensors"] > 0 or self.objects["arrow"] > 0:
            found.append(f"more live tensors/Arrow objects: {self.objects}")
        return found


def _soak(steps: int, warmup: int = WARMUP) -> Growth:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh())
    model.add_module("head", nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sink = CountingSink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    x = torch.randn(8, 16)

    def step(i: int) -> None:
        out = model(x)
        if i % 3 == 2:
            return  # a forward whose backward never comes (its graph is simply dropped)
        if i % 5 == 4:
            model(x).sum()  # a second outstanding forward, also never backpropagated
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: intra-op threads only add contention
    try:
        for i in range(warmup):
            step(i)
        tracemalloc.start()  # traces what the measured steps allocate (and still hold)
        before, rows_before = _snapshot(), sink.history_rows
        for i in range(warmup, warmup + steps):
            step(i)
        after = _snapshot()
    finally:
        tracemalloc.stop()
        torch.set_num_threads(threads)
        remove_observer(model)
    assert sink.closed == 1
    return Growth(
        after.arrow - before.arrow,
        after.python - before.python,
        {k: after.objects[k] - before.objects[k] for k in ("all", "tensors", "arrow")},
        sink.history_rows - rows_before,
    )


def _forwards(start: int, stop: int) -> int:
    return sum(1 + (i % 5 == 4 and i % 3 != 2) for i in range(start, stop))


def test_many_sampled_steps_keep_memory_and_live_objects_flat() -> None:
    growth = _soak(STEPS)
    # every measured step was sampled: at least 5 layers x the metrics of outputs per forward
    assert growth.history_rows >= _forwards(WARMUP, WARMUP + STEPS) * 5 * len(DEFAULT_METRICS)
    assert growth.problems() == [], growth


def test_a_planted_leak_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defect the bounds exist for: an observer that keeps every batch it emits."""
    kept: list[pa.RecordBatch] = []
    history, histograms = SinkFanout.write_history, SinkFanout.write_histograms

    def keep_history(self: SinkFanout, batch: pa.RecordBatch) -> None:
        kept.append(batch)
        history(self, batch)

    def keep_histograms(self: SinkFanout, batch: pa.RecordBatch) -> None:
        kept.append(batch)
        histograms(self, batch)

    monkeypatch.setattr(SinkFanout, "write_history", keep_history)
    monkeypatch.setattr(SinkFanout, "write_histograms", keep_histograms)
    growth = _soak(STEPS // 4, warmup=20)
    assert len(kept) > STEPS // 4
    problems = growth.problems()
    # each measure sees it on its own
    assert [p.split(" ")[0] for p in problems] == [
        "Arrow",
        "Python",
        str(growth.objects["all"]),
        "more",
    ]
