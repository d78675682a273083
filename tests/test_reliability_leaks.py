"""Leaks: many sampled steps, including forwards that never get a backward, keep process memory
and the count of live tensors flat (a generous bound here; benchmarks/soak.py runs the full
20,000 steps and measures precisely)."""

from __future__ import annotations

import gc
import warnings

import psutil
import pyarrow as pa
import torch
from torch import nn

from ti_core import AlwaysSampler, RunInfo, inject_observer, remove_observer

STEPS = 600
WARMUP = 100
"""Scaled to the shared 2-core CI budget (a sampled step of this model costs ~20 ms there)."""


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


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module proxies
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def test_many_sampled_steps_keep_memory_and_live_tensors_flat() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: intra-op threads only add contention
    try:
        _soak()
    finally:
        torch.set_num_threads(threads)


def _soak() -> None:
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

    try:
        for i in range(WARMUP):
            step(i)
        tensors, rss = _live_tensors(), _rss()
        for i in range(WARMUP, STEPS):
            step(i)
        tensors_after, rss_after = _live_tensors(), _rss()
    finally:
        remove_observer(model)
    assert sink.closed == 1
    # every step was sampled and measured: 5 layers x 9 metrics of outputs per forward
    forwards = STEPS + sum(1 for i in range(STEPS) if i % 5 == 4 and i % 3 != 2)
    assert sink.history_rows >= forwards * 5 * 9
    assert tensors_after - tensors <= 20, (tensors, tensors_after)
    assert rss_after - rss <= 48 * 2**20, (rss, rss_after)
