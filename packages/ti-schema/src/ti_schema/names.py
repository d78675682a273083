"""Names shared by every producer and reader: signals and the default metric profile."""

from __future__ import annotations

from typing import Final, Literal, get_args

Signal = Literal["output", "output_gradient"]
"""A value of the ``signal`` column."""
Mode = Literal["train", "eval"]
"""A value of the ``mode`` column."""

SIGNALS: Final[tuple[Signal, ...]] = get_args(Signal)
"""Values of the ``signal`` column: a module's output, and the gradient with respect to it."""

MODES: Final[tuple[Mode, ...]] = get_args(Mode)
"""Values of the ``mode`` column: the module's own ``training`` flag at the call."""

FINITE_METRICS: Final[tuple[str, ...]] = ("mean", "std", "min", "max", "p25", "p50", "p75")
"""Metrics computed over the finite entries of a tensor (std is the population std)."""

FRACTION_METRICS: Final[tuple[str, ...]] = ("zero_fraction", "nonfinite_fraction")
"""Metrics computed over all entries; the denominator is the original element count."""

DEFAULT_METRICS: Final[tuple[str, ...]] = FINITE_METRICS + FRACTION_METRICS
"""The default metric profile, in the order producers emit it."""

METRIC_DEFINITIONS: Final[dict[str, str]] = {
    "mean": "arithmetic mean of the finite entries",
    "std": "population standard deviation (ddof=0) of the finite entries",
    "min": "smallest finite entry",
    "max": "largest finite entry",
    "p25": "25th percentile of the finite entries, linear interpolation (numpy's default)",
    "p50": "median of the finite entries, linear interpolation",
    "p75": "75th percentile of the finite entries, linear interpolation",
    "zero_fraction": "entries exactly equal to zero divided by the element count",
    "nonfinite_fraction": "NaN, +Inf and -Inf entries divided by the element count",
}
"""One-line definition of each default metric, for docs and index.md."""
