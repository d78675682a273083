"""Samplers decide per root forward: forward_index counts root forwards, sample_id sampled ones."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from _core_helpers import rows
from torch import nn

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    MemorySink,
    TimedSampler,
    inject_observer,
    observe,
    remove_observer,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_timed_sampler_first_forward_then_first_after_each_interval() -> None:
    clock = FakeClock()
    sampler = TimedSampler(timedelta(seconds=10), clock=clock)
    decisions = []
    for t in (0, 5, 9.99, 10, 12, 35, 39, 40, 41, 1000):
        clock.now = 1000.0 + t
        decisions.append((t, sampler.should_sample(0)))
    assert [t for t, sampled in decisions if sampled] == [0, 10, 35, 40, 1000]
    assert repr(sampler) == "TimedSampler(interval=10s)"


def test_timed_sampler_accepts_seconds_and_resets() -> None:
    clock = FakeClock()
    sampler = TimedSampler(2.5, clock=clock)
    assert sampler.should_sample(0)
    assert not sampler.should_sample(1)
    sampler.reset()
    assert sampler.should_sample(2)


def test_every_n_and_always() -> None:
    every = EveryNForwardsSampler(3)
    assert [i for i in range(10) if every.should_sample(i)] == [0, 3, 6, 9]
    assert all(AlwaysSampler().should_sample(i) for i in range(5))


def test_observer_counts_root_forwards_with_an_injected_clock() -> None:
    clock = FakeClock()
    model = nn.Sequential(nn.Linear(2, 2))
    sink = MemorySink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=TimedSampler(timedelta(minutes=1), clock=clock)
    )
    for step in range(10):
        clock.now = 1000.0 + 25.0 * step  # 0, 25, 50, 75 (sampled), ..., 125 (sampled), ...
        model(torch.randn(1, 2))
    remove_observer(model)
    pairs = sorted({(r["sample_id"], r["forward_index"]) for r in rows(sink.table())})
    assert pairs == [(0, 0), (1, 3), (2, 5), (3, 8)]


def test_default_interval_is_a_minute_and_interval_configures_it() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink):
        for _ in range(5):
            model(torch.randn(1, 2))
    assert sink.run is not None
    assert sink.run.sampler == "TimedSampler(interval=60s)"
    assert {r["forward_index"] for r in rows(sink.table())} == {0}
    sink2 = MemorySink()
    with observe(model, output_dir=None, sink=sink2, interval=timedelta(hours=2)):
        model(torch.randn(1, 2))
    assert sink2.run is not None
    assert sink2.run.sampler == "TimedSampler(interval=7200s)"


@pytest.mark.parametrize("n", [1, 4])
def test_every_n_forwards_in_the_observer(n: int) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(n)):
        for _ in range(9):
            model(torch.randn(1, 2)).sum().backward()
    table = sink.table()
    expected = list(range(0, 9, n))
    assert sorted({r["forward_index"] for r in rows(table)}) == expected
    assert sorted({r["sample_id"] for r in rows(table)}) == list(range(len(expected)))
    for fi in expected:
        # each sampled forward's gradients carry that forward's ids
        assert {
            r["sample_id"] for r in rows(table, forward_index=fi, signal="output_gradient")
        } == {expected.index(fi)}


def test_unsampled_forwards_install_no_module_hooks() -> None:
    clock = FakeClock()
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=TimedSampler(60, clock=clock))
    model(torch.randn(1, 2))  # sampled
    clock.now += 1
    model(torch.randn(1, 2))  # unsampled: module capture is removed at its root boundary
    assert not model[0]._forward_hooks
    assert not model[1]._forward_hooks
    assert len(model._forward_pre_hooks) == 1
    assert len(model._forward_hooks) == 1
    remove_observer(model)
