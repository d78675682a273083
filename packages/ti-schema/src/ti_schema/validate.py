"""Validation of Arrow data against ``ti.history`` and ``ti.histograms``.

Checked: column names, types, nullability and the ``ti`` schema metadata (with the reader
compatibility rule of :mod:`ti_schema.compat`); for tables and batches also the data rules
(no nulls in not-null columns, ``value``/``unavailable_reason`` exclusivity, ``signal`` and
``mode`` domains, the ``signal`` values of the data's own version, histogram bucket
consistency; on request the declared fraction metrics in ``[0, 1]``,
``validate_history(profile=DEFAULT_PROFILE)``). Field-level ``doc`` metadata and column order
are informative and never checked: engines such as Polars drop the former on a round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Final, Literal

import pyarrow as pa
import pyarrow.compute as pc

from ti_schema.compat import MetadataSource, read_metadata, version_problems
from ti_schema.errors import Mismatch, SchemaMismatchError
from ti_schema.events import ADDED_IN as EVENT_COLUMNS_ADDED_IN
from ti_schema.events import EVENT_KINDS, EVENT_SIGNALS, REPLAY_VERDICTS, events_schema
from ti_schema.metrics import MetricProfile
from ti_schema.names import MODES
from ti_schema.precision import metric_name_problem
from ti_schema.schemas import (
    EVENTS,
    HISTOGRAMS,
    HISTORY,
    SchemaName,
    histogram_schema,
    history_schema,
)
from ti_schema.signals import SIGNAL_DECLARATION, SignalDeclaration
from ti_schema.version import SCHEMA_MAJOR, SCHEMA_MINOR

Nullability = Literal["schema", "data"]
"""How not-null columns are checked: ``"schema"`` requires the Arrow field to be declared not
null; ``"data"`` (tables only) accepts a field declared nullable when it holds no nulls, for
engines that drop Arrow's nullability flag (Polars marks every column nullable)."""

_UTC: Final[frozenset[str]] = frozenset({"UTC", "Etc/UTC", "+00:00"})
_NON_NEGATIVE: Final[tuple[str, ...]] = ("rank", "sample_id", "forward_index", "call_index")


DataRules = Callable[[pa.Table, frozenset[str], "tuple[int, int] | None"], list[Mismatch]]


@dataclass(frozen=True)
class Contract:
    """What one schema version requires; ``added_in`` maps a column to the minor that added it."""

    name: SchemaName
    schema: pa.Schema
    version: tuple[int, int] = (SCHEMA_MAJOR, SCHEMA_MINOR)
    added_in: Mapping[str, int] = field(default_factory=dict)
    data_rules: DataRules | None = None
    """Rules on the rows: ``(table, usable columns, the data's version or None) -> problems``."""

    @property
    def label(self) -> str:
        return f"{self.name} {self.version[0]}.{self.version[1]}"


def _is_string(typ: pa.DataType) -> bool:
    string_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return bool(
        pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or (string_view is not None and string_view(typ))
    )


def _is_list(typ: pa.DataType) -> bool:
    views = [getattr(pa.types, n, None) for n in ("is_list_view", "is_large_list_view")]
    return bool(
        pa.types.is_list(typ)
        or pa.types.is_large_list(typ)
        or any(v is not None and v(typ) for v in views)
    )


def type_matches(actual: pa.DataType, expected: pa.DataType) -> bool:
    """Whether a column of type ``actual`` is acceptable where the contract says ``expected``.

    Strings may also be large_string, string_view or dictionary-encoded (any integer index);
    lists may be large lists or list views of the same value type; a UTC timestamp may spell
    its zone ``UTC``, ``Etc/UTC`` or ``+00:00``. Everything else must be equal.
    """
    if actual == expected:
        return True
    if _is_string(expected):
        if pa.types.is_dictionary(actual):
            return bool(pa.types.is_integer(actual.index_type)) and _is_string(actual.value_type)
        return _is_string(actual)
    if _is_list(expected):
        return _is_list(actual) and actual.value_type == expected.value_type
    if pa.types.is_timestamp(expected) and pa.types.is_timestamp(actual):
        return actual.unit == expected.unit and actual.tz in _UTC and expected.tz in _UTC
    return False


def _describe(f: pa.Field) -> str:
    return f"{f.type}{'' if f.nullable else ' not null'}"


def _as_arrow(source: Any, function: str) -> tuple[pa.Schema, pa.Table | None]:
    if isinstance(source, pa.Schema):
        return source, None
    if isinstance(source, pa.Table):
        return source.schema, source
    if isinstance(source, pa.RecordBatch):
        return source.schema, pa.Table.from_batches([source])
    if hasattr(source, "__arrow_c_stream__"):
        table = pa.table(source)
        return table.schema, table
    if hasattr(source, "__arrow_c_schema__"):
        return pa.schema(source), None
    raise TypeError(
        f"{function}(table_or_schema) takes a pyarrow Table, RecordBatch or Schema (or an object "
        f"exporting Arrow data, such as a polars DataFrame), got {type(source).__name__}"
    )


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


def _counted(where: str, count: int, first: int, template: str) -> _Counted:
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
                    merged[key] = _counted(known.where, count, first, problem.template)
                else:
                    merged[key] = _counted(problem.where, problem.count, first, problem.template)
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
                    _counted(
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
        _counted(
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


def _history_rules(
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
                _counted(
                    "columns 'value'/'unavailable_reason'",
                    count,
                    first,
                    "{count} row(s), first at row {first}, break the rule that value is null "
                    "exactly when unavailable_reason is not null",
                )
            )
    return problems


def _histogram_rules(
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
                _counted(
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
                        _counted(
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
        _counted(
            "columns 'bucket_counts'/'num'",
            len(bad),
            bad[0],
            "{count} row(s), first at row {first}, have bucket counts that do not sum to num",
        )
    ]


def _column_problems(
    schema: pa.Schema,
    contract: Contract,
    version: tuple[int, int] | None,
    nullability: Nullability,
    table: pa.Table | None,
) -> tuple[list[Mismatch], frozenset[str]]:
    problems: list[Mismatch] = []
    usable: set[str] = set()
    names = list(schema.names)
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(
            Mismatch("duplicate_column", f"column {name!r}", f"appears {names.count(name)} times")
        )
    data_minor = version[1] if version is not None else contract.version[1]
    newer = version is not None and version[1] > contract.version[1]
    for expected in contract.schema:
        where = f"column {expected.name!r}"
        if expected.name not in names:
            if contract.added_in.get(expected.name, 0) <= data_minor:
                problems.append(
                    Mismatch(
                        "missing_column", where, f"is missing (expected {_describe(expected)})"
                    )
                )
            continue
        actual = schema.field(names.index(expected.name))
        if not type_matches(actual.type, expected.type):
            problems.append(
                Mismatch(
                    "type", where, f"has type {actual.type}; the contract says {expected.type}"
                )
            )
            continue
        usable.add(expected.name)
        if expected.nullable and not actual.nullable:
            problems.append(
                Mismatch(
                    "nullability",
                    where,
                    "is declared not null; the contract makes it nullable (rows with unavailable "
                    "values need nulls)",
                )
            )
        elif (
            not expected.nullable
            and actual.nullable
            and not (nullability == "data" and table is not None)
        ):
            problems.append(
                Mismatch(
                    "nullability",
                    where,
                    "is declared nullable; the contract says not null (declare the field "
                    "nullable=False, or validate with nullability='data' for engines that drop "
                    "the flag)",
                )
            )
        if table is not None and not expected.nullable:
            nulls = table.column(names.index(expected.name)).null_count
            if nulls:
                template = "holds {count} null(s); the contract says not null"
                problems.append(_counted(where, nulls, -1, template))
    known = set(contract.schema.names)
    for name in dict.fromkeys(names):
        if name in known:
            continue
        actual = schema.field(names.index(name))
        where = f"column {name!r}"
        if not newer:
            problems.append(Mismatch("extra_column", where, f"is not part of {contract.label}"))
        elif not actual.nullable:
            problems.append(
                Mismatch(
                    "extra_column",
                    where,
                    f"is not part of {contract.label}; a newer minor may only add nullable "
                    "columns, and this one is declared not null",
                )
            )
    return problems, frozenset(usable)


def problems_for(
    source: Any,
    contract: Contract,
    *,
    metadata: MetadataSource = None,
    nullability: Nullability = "schema",
    function: str = "validate",
) -> list[Mismatch]:
    """Every mismatch between ``source`` and ``contract``; an empty list means it conforms."""
    if nullability not in ("schema", "data"):
        raise ValueError(f"nullability must be 'schema' or 'data', got {nullability!r}")
    schema, table = _as_arrow(source, function)
    doc, problems = read_metadata(schema if metadata is None else metadata)
    version: tuple[int, int] | None = None
    if doc is not None:
        version, more = version_problems(doc, contract.name)
        problems += more
        if version is not None and version[0] != contract.version[0]:
            return problems  # another major: its columns mean nothing to this reader
    columns, usable = _column_problems(schema, contract, version, nullability, table)
    problems += columns
    if table is not None and contract.data_rules is not None:
        problems += contract.data_rules(table, usable, version)
    return problems


def _event_rules(
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
                _counted(
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
                _counted(
                    "columns 'layers'/'tensor_paths'",
                    count,
                    first,
                    "{count} row(s), first at row {first}, hold lists of different lengths; "
                    "they pair position by position",
                )
            )
    return problems


HISTORY_CONTRACT: Final[Contract] = Contract(
    HISTORY, history_schema("ti-schema"), data_rules=_history_rules
)
HISTOGRAMS_CONTRACT: Final[Contract] = Contract(
    HISTOGRAMS, histogram_schema("ti-schema"), data_rules=_histogram_rules
)
EVENTS_CONTRACT: Final[Contract] = Contract(
    EVENTS, events_schema("ti-schema"), added_in=EVENT_COLUMNS_ADDED_IN, data_rules=_event_rules
)
"""``ti.events`` exists from contract 1.3 on; data of an older version has no events table."""


def row_group_problems(
    row_groups: Iterable[pa.Table],
    contract: Contract,
    schema: pa.Schema,
    *,
    metadata: MetadataSource = None,
) -> list[Mismatch]:
    """:func:`problems_for` of a table given one row group at a time (a Parquet file read in
    bounded memory): each row group is checked alone and the findings merged
    (:func:`merge_row_group_problems`), so counts and first rows are those of the whole table.
    ``schema``: the table's (checked alone when there is no row group)."""
    offset = 0
    seen = False

    def chunks() -> Iterator[tuple[int, list[Mismatch]]]:
        nonlocal offset, seen
        for table in row_groups:
            seen = True
            yield offset, problems_for(table, contract, metadata=metadata)
            offset += table.num_rows
        if not seen:
            yield 0, problems_for(schema.empty_table(), contract, metadata=metadata)

    return merge_row_group_problems(chunks())


def _raise_problems(
    source: Any,
    contract: Contract,
    metadata: MetadataSource,
    nullability: Nullability,
    function: str,
) -> None:
    """The one body of the ``validate_*`` functions: raise naming every problem, if any."""
    problems = problems_for(
        source, contract, metadata=metadata, nullability=nullability, function=function
    )
    if problems:
        raise SchemaMismatchError(contract.name, problems)


def validate_history(
    table_or_schema: Any,
    *,
    metadata: MetadataSource = None,
    nullability: Nullability = "schema",
    profile: MetricProfile | None = None,
    signals: SignalDeclaration = SIGNAL_DECLARATION,
) -> None:
    """Raise :class:`SchemaMismatchError` listing every way the data breaks ``ti.history``.

    ``table_or_schema``: a pyarrow Table, RecordBatch or Schema (data rules need a table).
    ``metadata``: schema metadata to use instead of the source's own, e.g.
    ``polars.read_parquet_metadata(path)`` for a frame read by Polars, which drops it.
    ``nullability``: ``"data"`` accepts not-null columns declared nullable when they hold no
    nulls (tables only), for engines that do not keep Arrow's nullability flag.
    ``profile``: a metric declaration (e.g. ``DEFAULT_PROFILE``) whose fraction metrics must
    then lie in ``[0, 1]``; None (default): metric values are not checked, as the contract
    lets any producer write any metric name;
    ``signals``: the signal declaration whose values (per contract version) ``signal`` holds.
    """
    contract = HISTORY_CONTRACT
    if profile is not None or signals is not SIGNAL_DECLARATION:
        rules = partial(_history_rules, profile=profile, signals=signals)
        contract = replace(contract, data_rules=rules)
    _raise_problems(table_or_schema, contract, metadata, nullability, "validate_history")


def validate_histograms(
    table_or_schema: Any,
    *,
    metadata: MetadataSource = None,
    nullability: Nullability = "schema",
    signals: SignalDeclaration = SIGNAL_DECLARATION,
) -> None:
    """Raise :class:`SchemaMismatchError` listing every way the data breaks ``ti.histograms``.

    Arguments as for :func:`validate_history`.
    """
    contract = HISTOGRAMS_CONTRACT
    if signals is not SIGNAL_DECLARATION:
        contract = replace(contract, data_rules=partial(_histogram_rules, signals=signals))
    _raise_problems(table_or_schema, contract, metadata, nullability, "validate_histograms")


def validate_events(
    table_or_schema: Any,
    *,
    metadata: MetadataSource = None,
    nullability: Nullability = "schema",
) -> None:
    """Raise :class:`SchemaMismatchError` listing every way the data breaks ``ti.events``.

    Arguments as for :func:`validate_history`.
    """
    _raise_problems(table_or_schema, EVENTS_CONTRACT, metadata, nullability, "validate_events")
