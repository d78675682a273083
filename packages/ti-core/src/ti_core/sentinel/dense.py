"""Dense capture: the root forwards an event asks to be sampled in full, ahead of the sampler.

Ownership: the observer wraps the run's sampler in one :class:`DenseSampler`; the gate asks it
as it would the sampler, and the flight recorder (:mod:`ti_core.sentinel.recorder`) calls
:meth:`DenseSampler.trigger`. Decisions are taken in root-forward order, so the first forward
of a capture is the first one not decided yet when it is asked for.
"""

from __future__ import annotations

import threading

from ti_core.sampling import Sampler


class DenseSampler:
    """The run's sampler, overridden for the forwards a trigger asked for."""

    def __init__(self, base: Sampler) -> None:
        self.base = base
        self._lock = threading.Lock()
        self._decided = -1  # the highest forward index decided so far
        self._until = -1  # forwards up to this index (inclusive) are sampled in full

    def trigger(self, forwards: int) -> int:
        """Sample the next ``forwards`` undecided root forwards in full; returns the first one's
        index. A trigger during a capture extends it."""
        with self._lock:
            first = self._decided + 1
            self._until = max(self._until, first + forwards - 1)
            return first

    def should_sample(self, forward_index: int) -> bool:
        with self._lock:
            if forward_index > self._decided:
                self._decided = forward_index
            if forward_index <= self._until:
                return True
        return bool(self.base.should_sample(forward_index))

    def __repr__(self) -> str:
        return repr(self.base)


__all__ = ["DenseSampler"]
