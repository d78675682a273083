"""The data rules of ``ti.history``, ``ti.histograms`` and ``ti.events``: what each table's rows
must hold beyond its columns' types (checked by :mod:`ti_schema.validate` for tables and
batches), and the mismatches they report, which merge across the row groups of one file
(:func:`merge_row_group_problems`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc

from ti_schema.errors import Mismatch
from ti_schema.events import EVENT_KINDS, EVENT_SIGNALS, REPLAY_VERDICTS
from ti_schema.metrics import MetricProfile
from ti_schema.names import MODES
from ti_schema.precision import metric_name_problem
from ti_schema.signals import SIGNAL_DECLARATION, SignalDeclaration
from ti_schema.version import SCHEMA_MAJOR, SCHEMA_MINOR

_NON_NEGATIVE: Final[tuple[str, ...]] = ("rank", "sample_id", "forward_index", "call_index")


def _count_and_first(mask: pa.ChunkedArray) -> tuple[int, int]:
    mask = pc.fill_null(mask, False)
    count = pc.sum(pc.cast(mask, pa.int64())).as_py() or 0
    first = pc.index(mask, True).as_py() if count else -1
    return int(count), int(first)


@dataclass(frozen=True)
class _Counted(Mismatch):
    """A mismatch of a row rule: how many rows break it and the first (-1: not tracked).
    Row groups of one file merge by adding counts (:func:`merge_row_group_problems`)."""

    count: int = 0
    first: int = -1
    template: str = ""
    """The message with ``{count}`` and ``{first}`` placeholders."""


def counted(where: str, count: int, first: int, template: str) -> _Counted:
    message = template.format(count=count, first=first)
    return _Counted("data", where, message, count, first, template)


@dataclass(frozen=True)
class _Listed(Mismatch):
    """A mismatch of a value rule: the offending distinct values. Row groups of one file merge
    by uniting them and rendering the message again (``render``)."""

    values: frozenset[str] = frozenset()
    render: Callable[[frozenset[str]], str] | None = field(default=None, compare=False)
    rule: str = ""
    """Which rule (with ``where``, what merges)."""


def _listed(
    where: str, values: set[str], rule: str, render: Callable[[frozenset[str]], str]
) -> _Listed:
    frozen = frozenset(values)
    return _Listed("data", where, render(frozen), frozen, render, rule)


def merge_row_group_problems(chunks: Iterable[tuple[int, list[Mismatch]]]) -> list[Mismatch]:
    """The mismatches of a table given as those of its row groups (``(first row, mismatches)``
    each, validated alone): row counts added, first rows made table-wide, offending values
    united, the rest (schema problems every row group repeats) listed once; in the order each
    first appeared."""
    merged: dict[tuple[object, ...], Mismatch] = {}
    for offset, problems in chunks:
        for problem in problems:
            if isinstance(problem, _Counted):
                key: tuple[object, ...] = ("counted", problem.kind, problem.where, problem.template)
                first = problem.first + offset if problem.first >= 0 else -1
                known = merged.get(key)
                if isinstance(known, _Counted):
                    count = known.count + problem.count
                    first = known.first if known.first >= 0 else first
                    merged[key] = counted(known.where, count, first, problem.template)
                else:
                    merged[key] = counted(problem.where, problem.count, first, problem.template)
            elif isinstance(problem, _Listed) and problem.render is not None:
                key = ("listed", problem.kind, problem.where, problem.rule)
                known = merged.get(key)
                values = problem.values | (
                    known.values if isinstance(known, _Listed) else frozenset()
                )
                merged[key] = _listed(problem.where, set(values), problem.rule, problem.render)
            else:
                merged.setdefault(("plain", problem), problem)
    return list(merged.values())


def _distinct_strings(column: pa.ChunkedArray) -> set[str]:
    """Distinct non-null values of a string-like column, without decoding every row."""
    seen: set[str] = set()
    for chunk in column.chunks:
        if pa.types.is_dictionary(chunk.type):
            used = pc.unique(chunk.indices.drop_null())
            values = chunk.dictionary.take(used)
        else:
            values = pc.unique(chunk)
        seen.update(v for v in values.cast(pa.large_string()).to_pylist() if v is not None)
    return seen


def _domain(table: pa.Table, column: str, allowed: tuple[str, ...]) -> list[Mismatch]:
    bad = _distinct_strings(table.column(column)) - set(allowed)
    if not bad:
        return []

    def render(values: frozenset[str]) -> str:
        shown = sorted(values)
        return (
            f"holds {shown[:5]!r}{' ...' if len(shown) > 5 else ''}; allowed values are "
            f"{list(allowed)!r}"
        )

    return [_listed(f"column {column!r}", bad, "domain", render)]


def _signal_rule(
    table: pa.Table, version: tuple[int, int] | None, signals: SignalDeclaration
) -> list[Mismatch]:
    """``signal`` holds the values of the data's own contract version (this reader's when the
    data names none). Data of a newer minor may hold signals this reader does not know yet
    (a minor may add signal values); data of an older minor only those it knew."""
    found = _distinct_strings(table.column("signal"))
    minor = SCHEMA_MINOR if version is None else version[1]
    if minor > SCHEMA_MINOR:
        return []
    added_in = signals.added_in
    allowed = list(signals.of_minor(minor))
    too_new = sorted(s for s in found if s in added_in and s not in allowed)
    problems = []
    if found - set(signals.names):
        problems += _domain(table, "signal", signals.names)
    if too_new:

        def render(values: frozenset[str]) -> str:
            newer = sorted(values)
            added = max(added_in[s] for s in newer)
            return (
                f"holds {newer!r}, signals of contract {SCHEMA_MAJOR}.{added}, but the data "
                f"says version {SCHEMA_MAJOR}.{minor}, whose signals are {allowed!r}; write it "
                f"with schema_version {SCHEMA_MAJOR}.{added} or later"
            )

        problems.append(_listed("column 'signal'", set(too_new), "newer signals", render))
    return problems


def _negative(table: pa.Table, usable: frozenset[str], columns: tuple[str, ...]) -> list[Mismatch]:
    problems: list[Mismatch] = []
    for column in columns:
        if column in usable and table.num_rows:
            count, first = _count_and_first(pc.less(table.column(column), 0))
            if count:
                problems.append(
                    counted(
                        f"column {column!r}",
                        count,
                        first,
                        "{count} negative value(s), first at row {first}; it is 0-based",
                    )
                )
    return problems


def _common_rules(
    table: pa.Table,
    usable: frozenset[str],
    version: tuple[int, int] | None,
    signals: SignalDeclaration,
) -> list[Mismatch]:
    problems: list[Mismatch] = []
    if "signal" in usable:
        problems += _signal_rule(table, version, signals)
    if "mode" in usable:
        problems += _domain(table, "mode", MODES)
    return problems + _negative(table, usable, _NON_NEGATIVE)


def _is_in(column: pa.ChunkedArray, names: tuple[str, ...]) -> pa.ChunkedArray:
    """Per row: whether the string ``column`` holds one of ``names`` (a dictionary column is
    tested once per dictionary entry, not once per row)."""
    chunks = []
    for chunk in column.chunks:
        if pa.types.is_dictionary(chunk.type):
            entries = _is_in(pa.chunked_array([chunk.dictionary]), names).combine_chunks()
            chunks.append(pc.fill_null(entries.take(chunk.indices), False))
            continue
        if not (pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type)):
            chunk = chunk.cast(pa.large_string())  # string_view: is_in has no kernel for it
        chunks.append(pc.is_in(chunk, value_set=pa.array(names, chunk.type)))
    return pa.chunked_array(chunks, pa.bool_())


def _fraction_rule(table: pa.Table, profile: MetricProfile) -> list[Mismatch]:
    """The values of the profile's fraction metrics lie in ``[0, 1]``."""
    fractions = profile.fractions
    if not fractions:
        return []
    value = table.column("value")
    outside = pc.and_(
        _is_in(table.column("metric"), fractions),
        pc.or_(pc.less(value, 0), pc.greater(value, 1)),
    )
    count, first = _count_and_first(pc.fill_null(outside, False))
    if not count:
        return []
    return [
        counted(
            "column 'value'",
            count,
            first,
            f"{{count}} value(s) of the fraction metrics {list(fractions)}, first at row "
            "{first}, lie outside [0, 1]",
        )
    ]


PRECISION_MINOR: Final[int] = 3
"""The contract minor that reserved ``<metric>.<format>`` names for the precision metrics."""


def _metric_name_rule(table: pa.Table, version: tuple[int, int] | None) -> list[Mismatch]:
    """``<metric>.<format>`` names only a declared precision metric and format (data of a
    minor before the precision metrics may hold any name)."""
    if version is not None and version[1] < PRECISION_MINOR:
        return []
    names = _distinct_strings(table.column("metric"))
    bad = {name for name in names if metric_name_problem(name) is not None}
    if not bad:
        return []

    def render(values: frozenset[str]) -> str:
        problems = [p for p in map(metric_name_problem, sorted(values)) if p is not None]
        return "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else "")

    return [_listed("column 'metric'", bad, "metric names", render)]


def history_rules(
    table: pa.Table,
    usable: frozenset[str],
    version: tuple[int, int] | None,
    profile: MetricProfile | None = None,
    signals: SignalDeclaration = SIGNAL_DECLARATION,
) -> list[Mismatch]:
    problems = _common_rules(table, usable, version, signals)
    if "metric" in usable and table.num_rows:
        problems += _metric_name_rule(table, version)
    if profile is not None and {"metric", "value"} <= usable and table.num_rows:
        problems += _fraction_rule(table, profile)
    if {"value", "unavailable_reason"} <= usable and table.num_rows:
        value_null = pc.is_null(table.column("value"))
        reason_set = pc.is_valid(table.column("unavailable_reason"))
        count, first = _count_and_first(pc.not_equal(value_null, reason_set))
        if count:
            problems.append(
                counted(
                    "columns 'value'/'unavailable_reason'",
                    count,
                    first,
                    "{count} row(s), first at row {first}, break the rule that value is null "
                    "exactly when unavailable_reason is not null",
                )
            )
    return problems


def histogram_rules(
    table: pa.Table,
    usable: frozenset[str],
    version: tuple[int, int] | None,
    signals: SignalDeclaration = SIGNAL_DECLARATION,
) -> list[Mismatch]:
    problems = _common_rules(table, usable, version, signals)
    if not table.num_rows:
        return problems
    if {"bucket_limits", "bucket_counts"} <= usable:
        limits = pc.list_value_length(table.column("bucket_limits"))
        counts = pc.list_value_length(table.column("bucket_counts"))
        count, first = _count_and_first(pc.not_equal(limits, counts))
        if count:
            problems.append(
                counted(
                    "columns 'bucket_limits'/'bucket_counts'",
                    count,
                    first,
                    "{count} row(s), first at row {first}, have lists of different lengths",
                )
            )
    if "num" in usable:
        empty = pc.equal(table.column("num"), 0)
        for column in ("min", "max"):
            if column in usable:
                count, first = _count_and_first(
                    pc.not_equal(pc.is_null(table.column(column)), empty)
                )
                if count:
                    problems.append(
                        counted(
                            f"column {column!r}",
                            count,
                            first,
                            "{count} row(s), first at row {first}, break the rule that "
                            f"{column} is null exactly when num is 0",
                        )
                    )
        if "bucket_counts" in usable:
            problems += _bucket_sum_rule(table)
    return problems


def _bucket_sum_rule(table: pa.Table) -> list[Mismatch]:
    buckets = table.column("bucket_counts").combine_chunks()
    parents = pc.list_parent_indices(buckets)
    flat = pc.list_flatten(buckets)
    sums = pa.table({"row": parents, "n": flat}).group_by("row").aggregate([("n", "sum")])
    totals = [0] * table.num_rows
    for row, total in zip(
        sums.column("row").to_pylist(), sums.column("n_sum").to_pylist(), strict=True
    ):
        totals[row] = total or 0
    nums = table.column("num").to_pylist()
    bad = [i for i, (t, n) in enumerate(zip(totals, nums, strict=True)) if n is not None and t != n]
    if not bad:
        return []
    return [
        counted(
            "columns 'bucket_counts'/'num'",
            len(bad),
            bad[0],
            "{count} row(s), first at row {first}, have bucket counts that do not sum to num",
        )
    ]


def event_rules(
    table: pa.Table, usable: frozenset[str], version: tuple[int, int] | None
) -> list[Mismatch]:
    """``kind`` and ``signal`` domains; a nonfinite event names its signal and first module;
    ``layers`` and ``tensor_paths`` pair position by position."""
    problems: list[Mismatch] = []
    if "kind" in usable:
        problems += _domain(table, "kind", EVENT_KINDS)
    if "signal" in usable:
        problems += _domain(table, "signal", EVENT_SIGNALS)
    if "replay" in usable:
        problems += _domain(table, "replay", REPLAY_VERDICTS)
    problems += _negative(table, usable, ("rank", "event_id", "dense_forwards"))
    if {"kind", "signal", "layer"} <= usable and table.num_rows:
        nonfinite = pc.equal(table.column("kind").cast(pa.large_string()), "nonfinite")
        missing = pc.or_(pc.is_null(table.column("signal")), pc.is_null(table.column("layer")))
        count, first = _count_and_first(pc.and_(nonfinite, missing))
        if count:
            problems.append(
                counted(
                    "columns 'signal'/'layer'",
                    count,
                    first,
                    "{count} nonfinite event(s), first at row {first}, name no signal or no "
                    "first module",
                )
            )
    if {"layers", "tensor_paths"} <= usable and table.num_rows:
        unequal = pc.not_equal(
            pc.list_value_length(table.column("layers")),
            pc.list_value_length(table.column("tensor_paths")),
        )
        count, first = _count_and_first(unequal)
        if count:
            problems.append(
                counted(
                    "columns 'layers'/'tensor_paths'",
                    count,
                    first,
                    "{count} row(s), first at row {first}, hold lists of different lengths; "
                    "they pair position by position",
                )
            )
    return problems


__all__ = [
    "counted",
    "event_rules",
    "histogram_rules",
    "history_rules",
    "merge_row_group_problems",
]
