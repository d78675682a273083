"""Candidate bands for exact order statistics, placed by a small random sample.

Both engines find the quartiles of a large tensor without sorting it: a sample of
:data:`SAMPLE_SIZE` entries, drawn from a private generator seeded with :data:`SAMPLE_SEED` (the
global RNG states never change), places a narrow value band around each wanted rank; one pass
counts the entries below the band and collects the band, and the ranks are read from the sorted
band. A band that turns out not to hold its ranks is replaced by an exact fallback, so the
sample only decides the cost, never the result.
"""

from __future__ import annotations

import math
from typing import Final

SAMPLE_SIZE: Final = 1 << 16
"""Entries drawn (with replacement) to place the bands."""
SAMPLE_SEED: Final = 0x7149_5EED
"""Seed of the private generator that draws them."""


def sample_span(f_lo: float, f_hi: float, m: int) -> tuple[int, int]:
    """Indices into ``m`` sorted sample values that bracket the fractions ``[f_lo, f_hi]``.

    The margin is six standard errors of a sample quantile (at the middle fraction) plus a few
    sample slots: a band misses its ranks with negligible probability, and a miss only costs the
    exact fallback. The indices are not clamped: below 0 or from ``m`` on means "unbounded".
    """
    f = 0.5 * (f_lo + f_hi)
    margin = 6.0 * math.sqrt(max(f * (1.0 - f), 1.0 / m) / m) + 4.0 / m
    return math.floor((f_lo - margin) * (m - 1)), math.ceil((f_hi + margin) * (m - 1))


__all__ = ["SAMPLE_SEED", "SAMPLE_SIZE", "sample_span"]
