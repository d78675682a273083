"""What telemetry costs the run, measured in the run itself (docs/capture.md, "Sampling").

A *step* is the time from one outermost root forward's start to the next one's: it covers the
forward, its backward, the optimizer step and whatever the loop does in between. The gate tells
the :class:`CostMeter` of its observer, at every root forward, the time and whether that forward
is sampled (one ``time.perf_counter()`` call and a few arithmetic operations; an unsampled step
goes into a fixed ring, nothing is sorted). A step's length is known when the next root forward
starts, so the meter files it under the previous forward's decision.

The emission worker (reductions and writes of sampled signals on their own thread) tells the
meter when it gets work and when it runs out (:meth:`CostMeter.worker_busy`,
:meth:`CostMeter.worker_idle`, under its lock, off the training thread), so an unsampled step
is *clean* (the worker idle throughout) or *overlapped* (the worker busy at some point: where the
two compete for the GIL or a core, the training thread is slowed by the sample that queued the
work). The figure (:meth:`CostMeter.cost`, a :class:`~ti_schema.RunCost`)::

    telemetry_seconds = measured sampled steps x (median sampled step - median clean step)
                      + overlapped steps x (median overlapped step - median clean step)

each median over the latest steps of its kind (:data:`UNSAMPLED_WINDOW`,
:data:`SAMPLED_WINDOW`: bounded memory, and robust to a pause of the loop, a checkpoint or an
evaluation, that falls into one step), as a fraction of the time since attach. It is the method
of ``benchmarks/`` (a sampled step against the typical unsampled step of the same run), on the
training thread: the worker's own time is in it only as far as it slows the training thread.
Not measured: the run's first step,
which also carries the model's warmup (lazy initialization, allocator, autotuning), and the
steps of a model whose root hooks ``torch.compile`` traced into its graph (no Python runs at its
root forwards). Work done on every forward (the flight recorder's checks) is in both medians, so
it is not in the figure (``benchmarks/`` measures it).

Ownership: ``inject_observer`` creates one meter per run and binds it to a sampler that declares
:class:`MeteredSampler` (before any wrapper, such as rank alignment, hides it); the observer
starts it at attach, hands it to its gate, and hands its figure to the sinks' ``write_cost`` (at
removal, before a flush, and at most every :data:`REPORT_SECONDS` at a sampled forward). Root
forwards on several threads at once share the meter without a lock: a race may lose one step's
length, never raise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final, Protocol, runtime_checkable

from ti_schema.cost import COST_METHOD, RunCost

UNSAMPLED_WINDOW: Final[int] = 255
"""Unsampled steps the median is taken over (the latest ones)."""
SAMPLED_WINDOW: Final[int] = 63
"""Sampled steps the median is taken over (the latest ones)."""
REPORT_SECONDS: Final[float] = 60.0
"""At most this often, at a sampled forward, the latest figure goes to the sinks (so that a
run killed without removal keeps a recent one)."""


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


class _Ring:
    """The latest ``size`` values, in a preallocated list."""

    __slots__ = ("count", "position", "size", "values")

    def __init__(self, size: int) -> None:
        self.values = [0.0] * size
        self.size = size
        self.position = 0
        self.count = 0

    def add(self, value: float) -> None:
        position = self.position
        self.values[position] = value
        self.position = (position + 1) % self.size
        self.count += 1

    def latest(self) -> list[float]:
        return self.values[: min(self.count, self.size)]


class CostMeter:
    """The step times of one run, and the telemetry cost they give (module docstring)."""

    __slots__ = (
        "_clock",
        "_forwards",
        "_last",
        "_last_report",
        "_overlap_steps",
        "_previous",
        "_sampled",
        "_sampled_steps",
        "_skip_first",
        "_started",
        "_unsampled_steps",
        "_worker_idle_at",
    )

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started = clock()
        self._last_report = self._started
        self._last = 0.0
        self._previous: bool | None = None
        """Whether the latest root forward is sampled (None before the first)."""
        self._forwards = 0
        self._sampled = 0
        self._skip_first = True
        self._unsampled_steps = _Ring(UNSAMPLED_WINDOW)
        self._overlap_steps = _Ring(UNSAMPLED_WINDOW)
        self._sampled_steps = _Ring(SAMPLED_WINDOW)
        self._worker_idle_at = -math.inf
        """When the emission worker last ran out of work (+inf while it has some)."""

    def start(self) -> None:
        """The run's wall time starts now (the observer calls it at attach)."""
        self._started = self._last_report = self._clock()

    @property
    def clock(self) -> Callable[[], float]:
        """The meter's clock (seconds; ``time.perf_counter`` outside tests)."""
        return self._clock

    def forward(self, now: float, sampled: bool) -> None:
        """A root forward starts at ``now`` (the meter's clock); ``sampled``: its decision.
        Called by the gate for every outermost root forward."""
        last = self._last
        self._last = now
        previous = self._previous
        self._previous = sampled
        self._forwards += 1
        if sampled:
            self._sampled += 1
        if previous is False:
            if last >= self._worker_idle_at:  # the emission worker was idle the whole step
                self._unsampled_steps.add(now - last)
            else:
                self._overlap_steps.add(now - last)
        elif previous:
            self._sampled_step(now - last)
        else:  # the run's first root forward: its step also warms the model up
            self._skip_first = sampled

    def _sampled_step(self, seconds: float) -> None:
        if self._skip_first:
            self._skip_first = False
            return
        self._sampled_steps.add(seconds)

    def worker_busy(self) -> None:
        """The emission worker got work (called by it, under its lock, at each submit)."""
        self._worker_idle_at = math.inf

    def worker_idle(self) -> None:
        """The emission worker ran out of work (called by it, under its lock)."""
        self._worker_idle_at = self._clock()

    @property
    def sampled_forwards(self) -> int:
        return self._sampled

    @property
    def forwards(self) -> int:
        return self._forwards

    def median_unsampled_step(self) -> float | None:
        """Median length of the latest unsampled steps the emission worker did not overlap
        (None before the first)."""
        return _median(self._unsampled_steps.latest())

    def cost(self, now: float | None = None) -> RunCost:
        """The figure at ``now`` (default: the clock's now)."""
        wall = max((self._clock() if now is None else now) - self._started, 0.0)
        measured = self._sampled_steps.count
        overlapped = self._overlap_steps.count
        unsampled = self.median_unsampled_step()
        sampled = _median(self._sampled_steps.latest())
        overlap = _median(self._overlap_steps.latest())
        telemetry = fraction = None
        if unsampled is not None and sampled is not None:
            telemetry = measured * (sampled - unsampled)
            if overlap is not None:
                telemetry += overlapped * (overlap - unsampled)
            fraction = telemetry / wall if wall > 0 else None
        return RunCost(
            sampled_forwards=self._sampled,
            unsampled_forwards=self._forwards - self._sampled,
            measured_sampled_steps=measured,
            wall_seconds=wall,
            telemetry_seconds=telemetry,
            fraction=fraction,
            median_unsampled_step_seconds=unsampled,
            median_sampled_step_seconds=sampled,
            method=COST_METHOD,
            worker_overlap_steps=overlapped,
            median_worker_overlap_step_seconds=overlap,
        )

    def report_due(self) -> bool:
        """True at most once every :data:`REPORT_SECONDS` (the observer then reports)."""
        now = self._clock()
        if now - self._last_report < REPORT_SECONDS:
            return False
        self._last_report = now
        return True


@runtime_checkable
class MeteredSampler(Protocol):
    """A sampler that reads the run's measured cost (``BudgetSampler``): the observer calls
    ``bind_meter`` once, at attach, before the first forward."""

    def bind_meter(self, meter: CostMeter) -> None:
        """Read the cost of this run from ``meter`` from now on."""
        ...


__all__ = [
    "REPORT_SECONDS",
    "SAMPLED_WINDOW",
    "UNSAMPLED_WINDOW",
    "CostMeter",
    "MeteredSampler",
]
