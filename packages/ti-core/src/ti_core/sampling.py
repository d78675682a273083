"""Which root forwards are sampled.

The decision is taken once per *root* forward (the outermost call of the observed model), before
any selected module runs. A sampler only answers ``should_sample(forward_index)``; unsampled
forwards cost one call of it and nothing per module.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol, runtime_checkable

_SHORTEST_FORWARD = 1e-9
"""Seconds per forward below which a measurement is taken as this (a clock's resolution)."""

DEFAULT_INTERVAL = timedelta(minutes=1)
"""The default ``interval=`` of ``inject_observer`` (compared by identity to detect 'not given')."""


@runtime_checkable
class Sampler(Protocol):
    """Decides whether the root forward numbered ``forward_index`` (0-based) is sampled.

    Called on the thread running the forward, possibly from several threads at once.
    """

    def should_sample(self, forward_index: int) -> bool: ...


@runtime_checkable
class AheadSchedule(Sampler, Protocol):
    """A sampler that can also say in advance which root forward it samples next.

    In a ``torch.distributed`` job where several ranks observe, a sampler implementing this
    (``TimedSampler``, and any sampler of yours) is aligned across ranks
    (:class:`ti_core.aligned_sampling.AlignedSampler`): one rank, the leader, asks it for the
    next sampled index ahead of time and publishes it through the process group's store, so that
    every rank samples the same root forwards. Its own ``should_sample`` is used only without
    alignment (one process, or after a fallback).
    """

    def next_index(self, sampled_index: int, seconds_per_forward: float) -> int:
        """The index of the root forward sampled after ``sampled_index`` (greater than it).

        ``seconds_per_forward``: the leader's measured wall time per root forward (positive and
        finite), averaged over the forwards since its previous sample and including that
        sample's cost. Called on the leader only, on the training thread, in order, each index
        once: with 0 and then with the index that returned, both at forward 1; then, at each
        sample, with the index of the sample after it (decided, not run yet: one sample ahead).
        """
        ...


class AlwaysSampler:
    """Samples every root forward."""

    def should_sample(self, forward_index: int) -> bool:
        return True

    def __repr__(self) -> str:
        return "AlwaysSampler()"


class EveryNForwardsSampler:
    """Samples root forwards 0, n, 2n, ... (the first forward is always sampled)."""

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"EveryNForwardsSampler(n=...) needs an int >= 1, got {n!r}")
        count = int(n)
        if count < 1:
            raise ValueError(
                f"EveryNForwardsSampler(n={count}) needs n >= 1 (n=1 samples every forward)"
            )
        self.n: int = count

    def should_sample(self, forward_index: int) -> bool:
        return forward_index % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNForwardsSampler(n={self.n})"


def interval_seconds(interval: timedelta | float, name: str = "interval") -> float:
    """Validate an interval (timedelta or seconds) and return it in seconds."""
    if isinstance(interval, timedelta):
        seconds = interval.total_seconds()
    elif isinstance(interval, int | float) and not isinstance(interval, bool):
        seconds = float(interval)
    else:
        raise TypeError(f"{name}= must be a datetime.timedelta or seconds, got {interval!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{name}={interval!r} must be positive, e.g. timedelta(seconds=30); "
            "to sample every forward use sampler=AlwaysSampler()"
        )
    return seconds


class TimedSampler:
    """Samples the first root forward at once, then the first root forward after each interval.

    Intervals are anchored at the first sample (a fixed grid ``t0 + k * interval``), so the sample
    rate does not drift with the step time; a long pause yields one sample, not a burst.
    ``clock`` returns seconds (``time.monotonic`` by default) and can be replaced in tests.
    """

    def __init__(
        self,
        interval: timedelta | float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds = interval_seconds(interval)
        if not callable(clock):
            raise TypeError(f"TimedSampler(clock=...) must be callable, got {clock!r}")
        self._clock = clock
        self._start: float | None = None
        self._next = -math.inf
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget previous samples: the next forward is sampled (called at attach)."""
        with self._lock:
            self._start = None
            self._next = -math.inf

    def should_sample(self, forward_index: int) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        with self._lock:
            if now < self._next:
                return False
            if self._start is None:
                self._start = now
            periods = math.floor((now - self._start) / self.seconds) + 1
            self._next = self._start + periods * self.seconds
            return True

    def next_index(self, sampled_index: int, seconds_per_forward: float) -> int:
        """The first forward at least one interval after ``sampled_index``, at
        ``seconds_per_forward`` (:class:`AheadSchedule`)."""
        step = max(seconds_per_forward, _SHORTEST_FORWARD)
        return sampled_index + max(1, math.ceil(self.seconds / step - 1e-9))

    def __repr__(self) -> str:
        return f"TimedSampler(interval={self.seconds:g}s)"
