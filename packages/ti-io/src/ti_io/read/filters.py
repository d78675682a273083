"""The one layer / signal / metric selection of the readers (``ti summary``, ``compare_runs``,
``compare_series``, ``ti_dist.compare_ranks``).

Arguments are one name or a non-empty sequence of names (:func:`names`); signals must be the
contract's (:func:`signal_names`); layer globs follow ``fnmatch`` rules, case-sensitive
(:func:`matching_layers`). :func:`row_filter` keeps the rows of the names chosen.
"""

from __future__ import annotations

import fnmatch
import functools
import operator
from collections.abc import Sequence

import polars as pl

from ti_schema import SIGNALS


def names(value: str | Sequence[str] | None, what: str) -> list[str] | None:
    """``value`` as a list of names (None: no selection).

    Raises ``TypeError`` unless it is a string or a non-empty sequence of strings.
    """
    if value is None:
        return None
    values = [value] if isinstance(value, str) else list(value)
    if not values or not all(isinstance(v, str) for v in values):
        raise TypeError(
            f"{what} must be a string or a non-empty sequence of strings, got {value!r}"
        )
    return values


def signal_names(
    value: str | Sequence[str] | None, signals: Sequence[str] = SIGNALS
) -> list[str] | None:
    """:func:`names` of signals; raises ``ValueError`` naming those not in ``signals``."""
    chosen = names(value, "signal")
    if chosen is not None:
        unknown = sorted(set(chosen) - set(signals))
        if unknown:
            raise ValueError(f"signal must be one of {list(signals)} (or several), got {unknown}")
    return chosen


def matching_layers(layers: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The names of ``layers`` matched by any glob of ``patterns``, in their order."""
    return [n for n in layers if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def row_filter(
    *,
    layers: Sequence[str] | None = None,
    signals: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
) -> pl.Expr | None:
    """The rows whose layer, signal and metric are among the names given (None: any); None
    when nothing is selected."""
    conditions = [
        pl.col(column).is_in(list(chosen))
        for column, chosen in (("layer", layers), ("signal", signals), ("metric", metrics))
        if chosen is not None
    ]
    if not conditions:
        return None
    return functools.reduce(operator.and_, conditions)


def apply(frame: pl.LazyFrame, condition: pl.Expr | None) -> pl.LazyFrame:
    """``frame`` filtered by ``condition`` (a :func:`row_filter`; None keeps every row)."""
    return frame if condition is None else frame.filter(condition)
