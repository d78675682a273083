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

DEFAULT_INTERVAL = timedelta(minutes=1)
"""The default ``interval=`` of ``inject_observer`` (compared by identity to detect 'not given')."""


@runtime_checkable
class Sampler(Protocol):
    """Decides whether the root forward numbered ``forward_index`` (0-based) is sampled.

    Called on the thread running the forward, possibly from several threads at once.
    """

    def should_sample(self, forward_index: int) -> bool: ...


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

    def __repr__(self) -> str:
        return f"TimedSampler(interval={self.seconds:g}s)"
