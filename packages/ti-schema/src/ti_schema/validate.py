"""Validation of Arrow data against ``ti.history`` and ``ti.histograms``.

Checked: column names, types, nullability and the ``ti`` schema metadata (with the reader
compatibility rule of :mod:`ti_schema.compat`); for tables and batches also the data rules
(no nulls in not-null columns, ``value``/``unavailable_reason`` exclusivity, ``signal`` and
``mode`` domains, the ``signal`` values of the data's own version, histogram bucket
consistency; on request the declared fraction metrics in ``[0, 1]``,
``validate_history(profile=DEFAULT_PROFILE)``; the rules are :mod:`ti_schema.data_rules`).
Field-level ``doc`` metadata and column order are informative and never checked: engines such
as Polars drop the former on a round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Final, Literal

import pyarrow as pa

from ti_schema.compat import MetadataSource, read_metadata, version_problems
from ti_schema.data_rules import (
    counted,
    event_rules,
    histogram_rules,
    history_rules,
    merge_row_group_problems,
)
from ti_schema.errors import Mismatch, SchemaMismatchError
from ti_schema.events import ADDED_IN as EVENT_COLUMNS_ADDED_IN
from ti_schema.events import events_schema
from ti_schema.metrics import MetricProfile
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
                problems.append(counted(where, nulls, -1, template))
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


HISTORY_CONTRACT: Final[Contract] = Contract(
    HISTORY, history_schema("ti-schema"), data_rules=history_rules
)
HISTOGRAMS_CONTRACT: Final[Contract] = Contract(
    HISTOGRAMS, histogram_schema("ti-schema"), data_rules=histogram_rules
)
EVENTS_CONTRACT: Final[Contract] = Contract(
    EVENTS, events_schema("ti-schema"), added_in=EVENT_COLUMNS_ADDED_IN, data_rules=event_rules
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
        rules = partial(history_rules, profile=profile, signals=signals)
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
        contract = replace(contract, data_rules=partial(histogram_rules, signals=signals))
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
