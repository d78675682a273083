"""``BudgetSampler``: sample as often as keeps the run's measured telemetry cost under a budget.

It reads the run's :class:`~ti_core.cost.CostMeter` (bound by the observer at attach: the
:class:`~ti_core.cost.MeteredSampler` protocol) and decides, at each sampled forward, how many
forwards until the next one (:meth:`BudgetSampler.next_index`), so the decision for every other
forward is one comparison. With ``c`` the measured cost of one sample (the run's telemetry
seconds over its measured samples: the sampled step beyond a clean unsampled one, and the
unsampled steps its background work slowed), ``s`` the median clean unsampled step and ``f``
the budget, the next sample comes after the most of:

- ``c (1 - f) / (f s)`` forwards: the steady rate whose cost is exactly ``f`` of the time;
- as many as keep the run's whole figure (telemetry so far and this sample's, over the wall time
  until the next sample starts) at or under ``f``: an expensive start (the first samples are
  probes until there is a cost to read) is paid back before sampling again;
- ``min_forwards``;

and at most ``max_interval`` of wall time (so a model whose every sample costs more than the
budget allows is still sampled that often: the figure then exceeds the budget, and says so).
Until the meter has measured a cost, the sampler probes ``min_forwards``, then twice, four
times, ... as many forwards apart (so clean steps come between samples even where every sample's
background work outlasts the gap), up to ``max_interval``; a run that gives no measurement (the
meter is not bound, or ``torch.compile`` traced the root's hooks) ends up sampled every
``max_interval``, timed by the sampler's own seconds per forward. A figure at or under zero (the
steps' own spread outweighs what the samples cost, as on a large model with few samples yet)
counts as not measured: probing goes on rather than sampling every ``min_forwards``.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Final

from ti_core.cost import CostMeter
from ti_core.sampling import interval_seconds

DEFAULT_MAX_INTERVAL: Final[timedelta] = timedelta(minutes=10)


class BudgetSampler:
    """Samples the first root forward at once, then as often as keeps the measured telemetry
    cost at or under ``fraction`` of the run's wall time (module docstring).

    ``fraction``: the budget, in (0, 1) (0.01: 1 %). ``min_forwards``: at least this many
    forwards from one sample to the next (>= 1). ``max_interval`` (timedelta or seconds): a
    sample at least this often, whatever it costs. ``clock`` (seconds) is for tests.
    """

    def __init__(
        self,
        fraction: float = 0.01,
        *,
        min_forwards: int = 2,
        max_interval: timedelta | float = DEFAULT_MAX_INTERVAL,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
            raise TypeError(
                f"BudgetSampler(fraction=...) must be a float in (0, 1), e.g. 0.01 for 1 %, "
                f"got {fraction!r}"
            )
        budget = float(fraction)
        if not (0.0 < budget < 1.0):
            raise ValueError(
                f"BudgetSampler(fraction={fraction!r}) must be in (0, 1), e.g. 0.01 for 1 % of "
                "the wall time; to sample every forward use sampler=AlwaysSampler()"
            )
        if isinstance(min_forwards, bool) or not isinstance(min_forwards, numbers.Integral):
            raise TypeError(
                f"BudgetSampler(min_forwards=...) must be an int >= 1, got {min_forwards!r}"
            )
        if int(min_forwards) < 1:
            raise ValueError(
                f"BudgetSampler(min_forwards={min_forwards}) must be >= 1 (1 allows sampling "
                "consecutive forwards)"
            )
        if not callable(clock):
            raise TypeError(f"BudgetSampler(clock=...) must be callable, got {clock!r}")
        self.fraction: float = budget
        self.min_forwards: int = int(min_forwards)
        self.max_interval_seconds: float = interval_seconds(
            max_interval, "BudgetSampler(max_interval)"
        )
        self._clock: Callable[[], float] = clock
        self._meter: CostMeter | None = None
        self._lock: threading.Lock = threading.Lock()
        self._next: int = 0
        self._probes: int = 0
        self._last: tuple[int, float] | None = None
        """(index, clock) of the latest sample: the sampler's own seconds per forward."""

    def bind_meter(self, meter: CostMeter) -> None:
        """Read the run's cost from ``meter`` (the observer calls it at attach)."""
        if not isinstance(meter, CostMeter):
            raise TypeError(f"BudgetSampler.bind_meter needs a ti_core CostMeter, got {meter!r}")
        self._meter = meter

    def reset(self) -> None:
        """Forget previous samples: the next forward is sampled (called at attach)."""
        with self._lock:
            self._next = 0
            self._probes = 0
            self._last = None

    def should_sample(self, forward_index: int) -> bool:
        if forward_index < self._next:
            return False
        with self._lock:
            if forward_index < self._next:
                return False
            now = self._clock()
            per_forward = math.nan
            if self._last is not None and forward_index > self._last[0]:
                per_forward = (now - self._last[1]) / (forward_index - self._last[0])
            self._last = (forward_index, now)
            self._next = self.next_index(forward_index, per_forward)
            return True

    def next_index(self, sampled_index: int, seconds_per_forward: float) -> int:
        """The forward to sample after the sampled ``sampled_index``; ``seconds_per_forward``
        (NaN when unknown) stands in for the meter's median unsampled step until there is one.
        """
        meter = self._meter
        so_far = meter.cost() if meter is not None else None
        step = so_far.median_unsampled_step_seconds if so_far is not None else None
        if step is None or step <= 0:
            fallback = float(seconds_per_forward)
            step = fallback if math.isfinite(fallback) and fallback > 0 else None
        spent = so_far.telemetry_seconds if so_far is not None else None
        if (
            so_far is None
            or not so_far.measured_sampled_steps
            or spent is None
            or spent <= 0
            or step is None
        ):
            # Nothing measured yet (or every unsampled step overlapped the samples' work, or
            # the steps' spread outweighs the samples' cost: a figure at or under zero):
            # probe, further apart each time, so clean steps come between samples.
            gap = self.min_forwards * 2 ** min(self._probes, 40)
            self._probes += 1
            return sampled_index + (gap if step is None else self._bounded(gap, step))
        excess = spent / so_far.measured_sampled_steps  # per sample, the overlapped steps too
        budget = self.fraction
        steady = excess * (1.0 - budget) / (budget * step)
        # When the next sample starts, n forwards on: (spent + c) <= f * (wall + n s + c).
        catch_up = ((spent + excess) / budget - so_far.wall_seconds - excess) / step
        return sampled_index + self._bounded(max(steady, catch_up), step)

    def _bounded(self, forwards: float, step: float) -> int:
        longest = max(self.min_forwards, math.floor(self.max_interval_seconds / step))
        if not math.isfinite(forwards):
            return longest
        return min(max(self.min_forwards, math.ceil(forwards)), longest)

    def __repr__(self) -> str:
        return (
            f"BudgetSampler(fraction={self.fraction:g}, min_forwards={self.min_forwards}, "
            f"max_interval={self.max_interval_seconds:g}s)"
        )


__all__ = ["DEFAULT_MAX_INTERVAL", "BudgetSampler"]
