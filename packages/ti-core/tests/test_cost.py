"""The run's measured telemetry cost (ti_core.cost) and BudgetSampler (ti_core.budget).

Unit tests drive a real CostMeter with a fake clock (no timed assertions); the run tests check
the figure a real training run measured is present and consistent with the run's own data.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
import torch
from torch import nn

from ti_core import (
    BudgetSampler,
    EveryNForwardsSampler,
    MemorySink,
    RunCost,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_core.cost import SAMPLED_WINDOW, UNSAMPLED_WINDOW, CostMeter, MeteredSampler
from ti_core.sampling import AheadSchedule


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _drive(
    sampler: BudgetSampler | EveryNForwardsSampler,
    forwards: int,
    *,
    step: float = 0.010,
    cost: float = 0.050,
    overlap: int = 0,
    overlap_cost: float = 0.005,
    kinds: list[tuple[str, float]] | None = None,
) -> tuple[CostMeter, list[int], FakeClock]:
    """A training loop on a fake clock: every step takes ``step`` (-0.5, 0, +0.5 ms), a sampled one
    ``cost`` more; with ``overlap``, the emission worker works through the ``overlap`` unsampled
    steps after a sample, each ``overlap_cost`` slower. The gate's part (decide, then tell the
    meter) and the worker's (busy at the sample's submit, idle when done) as they do it.
    ``kinds`` collects each step's kind and length."""
    clock = FakeClock()
    meter = CostMeter(clock)
    if isinstance(sampler, BudgetSampler):
        sampler._clock = clock
        sampler.bind_meter(meter)
    sampled_at = []
    busy = 0
    for index in range(forwards):
        sampled = sampler.should_sample(index)
        meter.forward(clock.now, sampled)
        length = step + (index % 3 - 1) * 0.0005
        if sampled:
            sampled_at.append(index)
            length += cost
            kind = "sampled"
            if overlap:
                meter.worker_busy()
                busy = overlap
        elif busy:
            length += overlap_cost
            kind = "overlap"
            busy -= 1
        else:
            kind = "clean"
        clock.now += length
        if overlap and not busy and kind != "clean":
            meter.worker_idle()
        if kinds is not None:
            kinds.append((kind, length))
    return meter, sampled_at, clock


def test_meter_figure_is_the_difference_of_the_medians_against_numpy() -> None:
    clock = FakeClock()
    meter = CostMeter(clock)
    rng = np.random.default_rng(0)
    lengths = rng.uniform(0.01, 0.02, size=400)
    sampled = [i % 5 == 0 for i in range(400)]
    lengths[sampled] += 0.03
    lengths[0] += 5.0  # the first step warms the model up: not measured
    for length, decision in zip(lengths, sampled, strict=True):
        meter.forward(clock.now, decision)
        clock.now += float(length)
    figure = meter.cost()
    # steps 0..398 are known (the last one runs still); the first one is skipped
    known = lengths[:399]
    decisions = np.array(sampled[:399])
    unsampled_steps = known[~decisions][-UNSAMPLED_WINDOW:]
    sampled_steps = known[decisions][1:][-SAMPLED_WINDOW:]
    measured = int(decisions[1:].sum())
    expected = measured * (np.median(sampled_steps) - np.median(unsampled_steps))
    assert figure.sampled_forwards == 80
    assert figure.unsampled_forwards == 320
    assert figure.measured_sampled_steps == measured == 79
    assert figure.median_unsampled_step_seconds == pytest.approx(np.median(unsampled_steps))
    assert figure.median_sampled_step_seconds == pytest.approx(np.median(sampled_steps))
    assert figure.telemetry_seconds == pytest.approx(expected, rel=1e-12)
    assert figure.wall_seconds == pytest.approx(float(lengths.sum()))
    assert figure.fraction == pytest.approx(expected / lengths.sum(), rel=1e-12)


def test_meter_without_unsampled_steps_reports_unknown() -> None:
    clock = FakeClock()
    meter = CostMeter(clock)
    for _ in range(5):
        meter.forward(clock.now, True)
        clock.now += 0.01
    figure = meter.cost()
    assert figure.telemetry_seconds is None
    assert figure.fraction is None
    assert figure.sampled_forwards == 5
    assert figure.measured_sampled_steps == 3
    assert "not measured" in figure.describe()


@pytest.mark.parametrize("budget", [0.02, 0.005])
def test_budget_sampler_holds_its_budget_on_a_fake_clock(budget: float) -> None:
    meter, sampled_at, clock = _drive(BudgetSampler(budget), 40_000)
    figure = meter.cost(clock.now)
    assert sampled_at[0] == 0
    assert figure.fraction is not None
    # at or under the budget when each sample starts; within one sample's cost of it between
    assert 0.8 * budget <= figure.fraction <= budget + 0.050 / figure.wall_seconds
    # steady state: c (1 - f) / (f s) forwards apart
    steady = 0.050 * (1 - budget) / (budget * 0.010)
    gaps = np.diff(sampled_at[-5:])
    assert np.all(np.abs(gaps - steady) <= 0.05 * steady)


def test_steps_the_emission_worker_overlaps_are_telemetry_too() -> None:
    kinds: list[tuple[str, float]] = []
    meter, _, clock = _drive(EveryNForwardsSampler(10), 500, overlap=3, kinds=kinds)
    figure = meter.cost(clock.now)
    known = kinds[1:-1]  # the first step is not measured, the last one runs still
    by_kind = {k: np.array([x for kind, x in known if kind == k]) for k in ("sampled", "clean")}
    overlapped = np.array([x for kind, x in kinds[:-1] if kind == "overlap"])
    clean = float(np.median(by_kind["clean"][-255:]))
    expected = len(by_kind["sampled"]) * (np.median(by_kind["sampled"][-63:]) - clean)
    expected += len(overlapped) * (np.median(overlapped[-255:]) - clean)
    assert figure.worker_overlap_steps == len(overlapped) == 150
    assert figure.median_unsampled_step_seconds == pytest.approx(clean)
    assert figure.telemetry_seconds == pytest.approx(expected, rel=1e-12)
    assert "150 unsampled steps overlapped by the samples' background work" in figure.describe()
    # the budget holds with what the overlapped steps cost: 65 ms a sample, not 50
    meter, sampled_at, clock = _drive(BudgetSampler(0.01), 40_000, overlap=3)
    figure = meter.cost(clock.now)
    assert figure.fraction is not None
    assert 0.8 * 0.01 <= figure.fraction <= 0.01 + 0.065 / figure.wall_seconds
    steady = 0.065 * 0.99 / (0.01 * 0.010)
    assert np.all(np.abs(np.diff(sampled_at[-4:]) - steady) <= 0.05 * steady)


def test_a_smaller_budget_samples_less_and_bounds_hold() -> None:
    _, generous, _ = _drive(BudgetSampler(0.05), 5_000)
    _, strict, _ = _drive(BudgetSampler(0.005), 5_000)
    assert len(strict) < len(generous) / 5
    # cheap telemetry under a generous budget: every min_forwards forwards
    _, cheap, _ = _drive(BudgetSampler(0.5), 300, cost=0.001)
    assert set(np.diff(cheap[5:])) == {2}
    # sampled steps measured faster than unsampled ones (the steps' spread outweighs the cost):
    # not free telemetry to sample every min_forwards, probing goes on, further apart
    _, noisy, _ = _drive(BudgetSampler(0.01), 3_000, cost=-0.002)
    assert list(np.diff(noisy)) == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    # telemetry dearer than the budget allows: at least every max_interval (60 s = ~6,000)
    _, capped, _ = _drive(BudgetSampler(0.001, max_interval=60), 30_000, cost=20.0)
    assert max(np.diff(capped)) <= 6_000
    assert len(capped) >= 5


def test_budget_sampler_declares_what_the_observer_and_alignment_need() -> None:
    sampler = BudgetSampler()
    assert isinstance(sampler, MeteredSampler)
    assert isinstance(sampler, AheadSchedule)
    assert sampler.next_index(7, 0.01) == 9  # no cost measured yet: probes, further apart
    assert sampler.next_index(9, 0.01) == 13
    assert repr(sampler) == "BudgetSampler(fraction=0.01, min_forwards=2, max_interval=600s)"
    with pytest.raises(ValueError, match=r"fraction=1.5\) must be in \(0, 1\)"):
        BudgetSampler(1.5)
    with pytest.raises(TypeError, match=r"fraction=\.\.\.\) must be a float"):
        BudgetSampler("1%")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_forwards=0"):
        BudgetSampler(min_forwards=0)
    with pytest.raises(ValueError, match="max_interval"):
        BudgetSampler(max_interval=timedelta(0))
    with pytest.raises(TypeError, match="bind_meter needs"):
        sampler.bind_meter(object())  # type: ignore[arg-type]


def _deep() -> nn.Module:
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)])


def _train(model: nn.Module, steps: int, *, step_seconds: float = 0.0) -> None:
    x = torch.randn(4, 16)
    for _ in range(steps):
        model(x).square().mean().backward()
        if step_seconds:
            time.sleep(step_seconds)  # the rest of a training step: the optimizer, data loading


def test_a_real_run_measures_its_cost_from_its_own_steps() -> None:
    model = _deep()
    sink = MemorySink()
    inject_observer(model, sink=sink, output_dir=None, sampler=EveryNForwardsSampler(3))
    meter = observer_of(model).meter  # type: ignore[union-attr]
    _train(model, 60)
    remove_observer(model)
    cost = sink.cost
    assert isinstance(cost, RunCost)
    assert sink.close_count == 1
    samples = set(sink.table().column("sample_id").to_pylist())
    assert cost.sampled_forwards == len(samples) == 20
    assert cost.unsampled_forwards == 40
    assert cost.measured_sampled_steps == 19  # not the first, nor the last (still running)
    assert cost.median_sampled_step_seconds is not None
    assert cost.median_unsampled_step_seconds is not None
    # 40 layers measured in a sampled step: it costs more than an unsampled one
    assert cost.median_sampled_step_seconds > cost.median_unsampled_step_seconds
    assert cost.telemetry_seconds is not None
    assert cost.telemetry_seconds > 0
    assert cost.fraction is not None
    assert 0 < cost.fraction < 1
    assert cost.fraction == pytest.approx(cost.telemetry_seconds / cost.wall_seconds)
    assert meter.forwards == 60


def test_a_real_run_samples_fewer_forwards_at_a_smaller_budget() -> None:
    # A step that takes a few ms besides the model (sleeping: a loaded CI machine cannot make
    # it shorter), so telemetry is a modest part of it and the two budgets come far apart.
    counts = {}
    for budget in (0.3, 0.002):
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        sink = MemorySink()
        inject_observer(model, sink=sink, output_dir=None, sampler=BudgetSampler(budget))
        _train(model, 150, step_seconds=0.004)
        remove_observer(model)
        assert sink.cost is not None
        counts[budget] = sink.cost.sampled_forwards
        assert sink.run is not None
        assert sink.run.sampler.startswith("BudgetSampler(")
    assert counts[0.002] < counts[0.3]
