"""``LossSpike`` without a trainer: the spike test against numpy float64 on the window before
each loss, non-finite losses, one firing per excursion, bad arguments; and
``Attachment.report_loss`` turning a firing into a ``loss`` event and a dense capture on a
real model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from ti_core import EveryNForwardsSampler, MemorySink, Sentinel
from ti_trainers import LossSpike
from ti_trainers.attachment import Attachment
from ti_trainers.loss_spike import resolve_loss_trigger


def reference_reason(window: list[float], loss: float, z: float) -> str | None:
    """The spike test in numpy float64 (population sd), worded as LossSpike words it."""
    values = np.asarray(window, dtype=np.float64)
    mean, sd = float(np.mean(values)), float(np.std(values))
    if loss > mean + z * sd:
        return f"loss {loss:.6g} > mean {mean:.6g} + {z:g} sd ({sd:.6g}) of the last {len(window)}"
    return None


def test_a_spike_is_tested_against_the_window_before_it() -> None:
    rng = np.random.default_rng(0)
    history = [float(x) for x in rng.normal(1.0, 0.1, size=12)]
    mean, sd = float(np.mean(history)), float(np.std(history))
    for margin, fires in ((4.01, True), (3.99, False)):
        detector = LossSpike(z=4.0, window=50, min_history=10)
        assert [detector.check(x) for x in history] == [None] * 12
        loss = mean + margin * sd
        reason = detector.check(loss)
        expected = reference_reason(history, loss, 4.0)
        assert reason == expected
        assert (reason is not None) is fires
        assert detector.history == (*history, loss)  # a finite loss joins after its test
    assert reason is None
    assert reference_reason(history, mean + 4.01 * sd, 4.0) is not None


def test_min_history_and_the_window_of_the_last_losses() -> None:
    detector = LossSpike(z=3.0, window=5, min_history=4)
    assert [detector.check(x) for x in (1.0, 1.1, 0.9)] == [None] * 3
    assert detector.check(100.0) is None  # three losses: below min_history, not tested
    # the window keeps the last five: 100.0 leaves it after five more
    for x in (1.0, 1.05, 0.95, 1.0, 1.02):
        detector.check(x)
    assert detector.history == (1.0, 1.05, 0.95, 1.0, 1.02)
    window = list(detector.history)
    reason = detector.check(1.5)
    assert reason is not None
    assert reason == reference_reason(window, 1.5, 3.0)
    assert reason.endswith("of the last 5")


def test_random_runs_match_a_numpy_reference() -> None:
    """Long runs with planted spikes and NaNs: every decision as numpy's, with the arming
    rules (one firing per excursion and per test)."""
    rng = np.random.default_rng(7)
    for run in range(5):
        losses = [float(x) for x in rng.gamma(20.0, 0.05, size=300)]
        for position in rng.choice(np.arange(15, 300), size=12, replace=False):
            losses[position] = math.nan if run % 2 and position % 3 == 0 else losses[position] * 5
        detector = LossSpike(z=3.5, window=20, min_history=8)
        window: list[float] = []
        armed = {"nonfinite": True, "spike": True}
        for loss in losses:
            if math.isnan(loss):
                expected = "loss nan is not finite" if armed["nonfinite"] else None
                armed["nonfinite"] = False
            else:
                armed["nonfinite"] = True
                reason = reference_reason(window, loss, 3.5) if len(window) >= 8 else None
                expected = reason if armed["spike"] else None
                armed["spike"] = reason is None
                window = [*window, loss][-20:]
            assert detector.check(loss) == expected
            assert detector.history == tuple(window)


def test_non_finite_losses_fire_at_once_and_stay_out_of_the_window() -> None:
    detector = LossSpike()
    assert detector.check(math.nan) == "loss nan is not finite"  # no history needed
    assert detector.check(math.nan) is None  # the same excursion
    assert detector.check(math.inf) is None
    assert list(detector.history) == []
    assert detector.check(1.0) is None  # finite: re-armed
    assert detector.check(-math.inf) == "loss -inf is not finite"
    assert detector.check(1.0) is None
    assert detector.check(math.inf) == "loss inf is not finite"
    assert detector.history == (1.0, 1.0)


def test_one_firing_per_spike_and_a_nan_after_a_spike_still_fires() -> None:
    detector = LossSpike(z=4.0, window=50, min_history=10)
    for x in [1.0, 1.1] * 5:
        detector.check(x)
    assert detector.check(10.0) is not None
    assert detector.check(50.0) is None  # still the same excursion (above the threshold)
    assert detector.check(math.nan) == "loss nan is not finite"
    assert detector.check(1.05) is None  # below the threshold: re-armed
    window = list(detector.history)
    assert detector.check(200.0) == reference_reason(window, 200.0, 4.0)
    detector.reset()
    assert detector.history == ()
    assert detector.check(math.nan) is not None


def test_a_window_of_equal_losses_fires_on_any_loss_above_them() -> None:
    detector = LossSpike(min_history=3, window=3)
    for _ in range(3):
        assert detector.check(2.0) is None
    assert detector.check(2.0) is None  # not above
    assert detector.check(2.0000001) == "loss 2 > mean 2 + 4 sd (0) of the last 3"


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match=r"LossSpike\(z=0\)"):
        LossSpike(z=0)
    with pytest.raises(ValueError, match="finite"):
        LossSpike(z=math.inf)
    with pytest.raises(TypeError, match=r"LossSpike\(z=\.\.\.\)"):
        LossSpike(z=True)
    with pytest.raises(ValueError, match=r"LossSpike\(window=1\)"):
        LossSpike(window=1, min_history=1)
    with pytest.raises(TypeError, match=r"min_history=\.\.\."):
        LossSpike(min_history=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"min_history=20.*window=10"):
        LossSpike(window=10, min_history=20)
    with pytest.raises(TypeError, match="must be a float"):
        LossSpike().check("1.0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a float"):
        LossSpike().check(True)
    assert repr(LossSpike()) == "LossSpike(z=4, window=50, min_history=10)"


def test_the_loss_trigger_option() -> None:
    assert resolve_loss_trigger(None, "Cb") is None
    assert resolve_loss_trigger(False, "Cb") is None
    default = resolve_loss_trigger(True, "Cb")
    assert default is not None
    assert (default.z, default.window, default.min_history) == (4.0, 50, 10)
    mine = LossSpike(z=2.0)
    assert resolve_loss_trigger(mine, "Cb") is mine
    with pytest.raises(TypeError, match=r"Cb\(loss_trigger=\.\.\.\)"):
        resolve_loss_trigger(4.0, "Cb")
    with pytest.raises(TypeError, match=r"Cb\(loss_trigger=\.\.\.\)"):
        Attachment({}, "Cb", loss_trigger="yes")


@pytest.mark.parametrize("sentinel", [None, Sentinel(dense_forwards=2)])
def test_report_loss_records_a_loss_event_and_a_dense_capture(sentinel: Sentinel | None) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    sink = MemorySink()
    options: dict[str, object] = {
        "sink": sink,
        "output_dir": None,
        "sampler": EveryNForwardsSampler(1000),
    }
    if sentinel is not None:
        options["sentinel"] = sentinel
    attachment = Attachment(options, "Cb", loss_trigger=LossSpike(window=5, min_history=3))
    assert attachment.report_loss(math.nan) is None  # nothing attached yet: nothing read
    attachment.attach(net, default_dir=None, rank=0, world_size=1)  # type: ignore[arg-type]
    losses = [1.0, 1.1, 0.9, 1.0, 25.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    events = []
    generator = torch.Generator().manual_seed(1)
    for loss in losses:
        net(torch.randn(3, 4, generator=generator)).sum().backward()
        event = attachment.report_loss(loss)
        if event is not None:
            events.append(event)
    attachment.detach()

    dense = 4 if sentinel is None else 2
    (event,) = events
    window = [1.0, 1.1, 0.9, 1.0]
    (row,) = sink.events().to_pylist()
    assert row["kind"] == "loss"
    assert row["value"] == 25.0
    assert row["reason"] == reference_reason(window, 25.0, 4.0)
    assert row["forward_index"] == 4  # the forward of the step whose loss fired
    assert (row["dense_first_forward"], row["dense_forwards"]) == (5, dense)
    assert event.event_id == row["event_id"]
    forwards = {r["forward_index"] for r in sink.table().to_pylist()}
    assert forwards == {0, *range(5, 5 + dense)}
