"""The column layouts of the reduction engine's rows: the one definition every engine uses.

A **profile row** is what both engines (:mod:`~ti_core.reduction.numpy_rows`,
:mod:`~ti_core.reduction.torch_rows`) compute for one tensor: the default metrics in
``ti_schema.DEFAULT_METRICS`` order, then the count of finite entries, which decides on the host
which metrics are available (:class:`~ti_core.reduction.plan.ReductionPlan`).

A **histogram row** is what both engines compute for one focus tensor before it becomes a
:class:`~ti_core.reduction.histograms.HistogramData`: six moments, then the ``bins + 1`` bucket
edges, then the ``bins`` counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

from ti_schema import DEFAULT_METRICS

# ----------------------------------------------------------------------------- profile row

MEAN: Final = 0
STD: Final = 1
MIN: Final = 2
MAX: Final = 3
P25: Final = 4
P50: Final = 5
P75: Final = 6
ZERO_FRACTION: Final = 7
NONFINITE_FRACTION: Final = 8
FINITE_COUNT: Final = 9
"""Finite entries of the tensor (a count, not a metric: it decides availability)."""
WIDTH: Final = 10
"""Columns of a profile row."""

COLUMNS: Final[tuple[str, ...]] = (*DEFAULT_METRICS, "finite_count")
"""Name of each profile-row column; the metric columns are ``DEFAULT_METRICS`` in order."""

QUARTILES: Final = slice(P25, P75 + 1)
"""The order-statistic columns, one per quantile of ``quantiles.QUANTILES``."""
OVER_FINITE: Final = range(MEAN, P75 + 1)
"""Metrics over the finite entries, unavailable when a tensor has none (the two fractions are
over all entries and always reported)."""

_T = TypeVar("_T")


def in_order(columns: Mapping[int, _T]) -> list[_T]:
    """The values of every profile-row column, keyed by column, as a list in row order."""
    missing = [COLUMNS[c] for c in range(WIDTH) if c not in columns]
    if missing or len(columns) != WIDTH:
        raise ValueError(f"a profile row needs every column; missing {missing}")
    return [columns[c] for c in range(WIDTH)]


# ----------------------------------------------------------------------------- histogram row

H_MIN: Final = 0
H_MAX: Final = 1
H_NUM: Final = 2
"""Finite entries."""
H_SUM: Final = 3
H_SUM_SQUARES: Final = 4
H_NONFINITE: Final = 5
HISTOGRAM_HEAD: Final = 6
"""Columns before the bucket edges."""


def histogram_width(bins: int) -> int:
    """Columns of a histogram row with ``bins`` buckets."""
    return HISTOGRAM_HEAD + 2 * bins + 1


def histogram_edges(bins: int) -> slice:
    """The ``bins + 1`` bucket edges (left edge of the first bucket, then every right edge)."""
    return slice(HISTOGRAM_HEAD, HISTOGRAM_HEAD + bins + 1)


def histogram_counts(bins: int) -> slice:
    """The ``bins`` bucket counts."""
    return slice(HISTOGRAM_HEAD + bins + 1, HISTOGRAM_HEAD + 2 * bins + 1)


__all__ = [
    "COLUMNS",
    "FINITE_COUNT",
    "HISTOGRAM_HEAD",
    "H_MAX",
    "H_MIN",
    "H_NONFINITE",
    "H_NUM",
    "H_SUM",
    "H_SUM_SQUARES",
    "MAX",
    "MEAN",
    "MIN",
    "NONFINITE_FRACTION",
    "OVER_FINITE",
    "P25",
    "P50",
    "P75",
    "QUARTILES",
    "STD",
    "WIDTH",
    "ZERO_FRACTION",
    "histogram_counts",
    "histogram_edges",
    "histogram_width",
    "in_order",
]
