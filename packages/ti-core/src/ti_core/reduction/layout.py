"""The column layouts of the reduction engine's rows: the one definition every engine uses.

A **profile row** is what both engines (:mod:`~ti_core.reduction.numpy_rows`,
:mod:`~ti_core.reduction.torch_rows`) compute for one tensor: the metrics of a metric
declaration (``ti_schema.DEFAULT_PROFILE`` unless a test extends it) in its order, then the
count of finite entries, which decides on the host which metrics are available
(:class:`~ti_core.reduction.plan.ReductionPlan`). :class:`ProfileLayout` derives the columns
from the declaration; nothing is numbered by hand.

A **histogram row** is what both engines compute for one focus tensor before it becomes a
:class:`~ti_core.reduction.histograms.HistogramData`: six moments, then the ``bins + 1`` bucket
edges, then the ``bins`` counts.
"""

from __future__ import annotations

from typing import Final

from ti_schema import DEFAULT_PROFILE, MetricProfile

# ----------------------------------------------------------------------------- profile row

FINITE_COUNT_COLUMN: Final = "finite_count"
"""The last column of every profile row: finite entries of the tensor (a count, not a metric:
it decides availability)."""


class ProfileLayout:
    """The columns of a profile row, derived from a metric declaration: its metrics in
    declaration order, then :data:`FINITE_COUNT_COLUMN`."""

    def __init__(self, profile: MetricProfile) -> None:
        if FINITE_COUNT_COLUMN in profile:
            raise ValueError(f"{FINITE_COUNT_COLUMN!r} is the layout's own column, not a metric")
        self.profile = profile
        self.metrics: tuple[str, ...] = profile.names
        """The metric columns' names, in row order (the first ``width - 1`` columns)."""
        self.columns: tuple[str, ...] = (*profile.names, FINITE_COUNT_COLUMN)
        """Name of each column, in row order."""
        self.width = len(self.columns)
        self.finite_count = self.width - 1
        """Column of the finite count."""
        self.over_finite: frozenset[int] = frozenset(
            i for i, m in enumerate(profile) if m.over == "finite"
        )
        """Columns of the metrics over the finite entries, unavailable when a tensor has none
        (metrics over all entries are always reported)."""
        self._index = {name: i for i, name in enumerate(self.columns)}
        self.moment_columns: tuple[int, int, int, int] | None = (
            (self._index["mean"], self._index["std"], self._index["min"], self._index["max"])
            if {"mean", "std", "min", "max"} <= self._index.keys()
            else None
        )
        """Columns of ``mean``, ``std``, ``min``, ``max`` (what a histogram reuses), or None."""

    def index(self, name: str) -> int:
        """The column of ``name``; KeyError naming the columns otherwise."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no column {name!r} in the layout {list(self.columns)}") from None


DEFAULT_LAYOUT: Final = ProfileLayout(DEFAULT_PROFILE)
"""The layout of the default profile (``ti_schema.DEFAULT_PROFILE``)."""


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
    "DEFAULT_LAYOUT",
    "FINITE_COUNT_COLUMN",
    "HISTOGRAM_HEAD",
    "H_MAX",
    "H_MIN",
    "H_NONFINITE",
    "H_NUM",
    "H_SUM",
    "H_SUM_SQUARES",
    "ProfileLayout",
    "histogram_counts",
    "histogram_edges",
    "histogram_width",
]
