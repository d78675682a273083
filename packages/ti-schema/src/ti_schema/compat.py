"""Reading the ``ti`` schema metadata and the compatibility rule for readers.

The rule: a reader of ``X.Y`` reads any ``X.*``. A newer minor may only add nullable columns,
optional metadata keys and ``signal`` values (the column and value sides are applied by the
validators); an older minor may lack the columns added after it and holds only the signals it
knew; another major is refused with a message naming the versions this reader knows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

import pyarrow as pa

from ti_schema.cost import cost_problem
from ti_schema.errors import Mismatch, SchemaMismatchError
from ti_schema.schemas import (
    EVENTS,
    HISTOGRAMS,
    HISTORY,
    METADATA_KEY,
    UNRECORDABLE_COLUMNS,
    SchemaName,
    check_schema_name,
)
from ti_schema.version import SCHEMA_MAJOR, SCHEMA_VERSION

KNOWN_VERSIONS: Final[dict[SchemaName, tuple[str, ...]]] = {
    HISTORY: ("1.0", "1.1", "1.2", "1.3", "1.4", SCHEMA_VERSION),
    HISTOGRAMS: ("1.0", "1.1", "1.2", "1.3", "1.4", SCHEMA_VERSION),
    EVENTS: ("1.3", "1.4", SCHEMA_VERSION),
}
"""Every contract version this reader was written against, per schema name."""

REQUIRED_KEYS: Final[tuple[str, ...]] = ("schema", "schema_version", "producer")
"""Keys every ``ti`` metadata JSON object has."""
OPTIONAL_KEYS: Final[tuple[str, ...]] = ("window", "upgraded_from", "unrecorded", "telemetry_cost")
"""Run facts a ``ti`` metadata object may add (schema 1.1; ``telemetry_cost`` 1.4, a
:class:`~ti_schema.cost.RunCost` object; see ``ti_schema.schema_metadata``).
Other keys are ignored, so a newer minor may add more."""

_VERSION: Final[re.Pattern[str]] = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")

MetadataSource: TypeAlias = pa.Schema | pa.Table | pa.RecordBatch | Mapping[Any, Any] | None
"""What carries schema metadata: an Arrow schema/table/batch, or a metadata mapping such as
``pyarrow.parquet.read_metadata(path).metadata`` or ``polars.read_parquet_metadata(path)``."""


def parse_version(version: str) -> tuple[int, int]:
    """``"1.0"`` -> ``(1, 0)``; raises ValueError for anything but ``major.minor`` digits."""
    match = _VERSION.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"schema_version must look like '1.0' (major.minor), got {version!r}")
    return int(match.group(1)), int(match.group(2))


def _raw_metadata(source: MetadataSource) -> Mapping[Any, Any] | None:
    if isinstance(source, pa.Table | pa.RecordBatch):
        return source.schema.metadata  # type: ignore[no-any-return]
    if isinstance(source, pa.Schema):
        return source.metadata  # type: ignore[no-any-return]
    if source is None or isinstance(source, Mapping):
        return source
    raise TypeError(
        "metadata source must be a pyarrow Schema, Table or RecordBatch, or a metadata mapping "
        f"(e.g. pyarrow.parquet.read_metadata(path).metadata), got {type(source).__name__}"
    )


def read_metadata(source: MetadataSource) -> tuple[dict[str, Any] | None, list[Mismatch]]:
    """The decoded ``ti`` object (or None) and the problems met decoding it; never raises."""
    raw = _raw_metadata(source)
    value: Any = None
    for key, item in (raw or {}).items():
        name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        if name == METADATA_KEY.decode():
            value = item
    if value is None:
        return None, [
            Mismatch(
                "missing_metadata",
                "schema metadata",
                "no 'ti' key; write with ti_schema.history_schema()/histogram_schema() or "
                "reattach it (schema.with_metadata(ti_schema.schema_metadata(name, producer)))",
            )
        ]
    try:
        doc = json.loads(value)
    except (ValueError, TypeError) as exc:
        return None, [
            Mismatch("foreign_metadata", "schema metadata 'ti'", f"is not valid JSON ({exc})")
        ]
    if not isinstance(doc, dict):
        return None, [
            Mismatch(
                "foreign_metadata",
                "schema metadata 'ti'",
                f"must be a JSON object with {list(REQUIRED_KEYS)}, got {type(doc).__name__}",
            )
        ]
    return doc, []


def parse_metadata(source: MetadataSource) -> dict[str, Any]:
    """The ``ti`` metadata of ``source`` as a dict ``{schema, schema_version, producer}``.

    Raises :class:`SchemaMismatchError` when the key is absent or is not a JSON object.
    """
    doc, problems = read_metadata(source)
    if doc is None:
        raise SchemaMismatchError("ti metadata", problems)
    return doc


def _fact_problems(doc: Mapping[str, Any], where: str) -> list[Mismatch]:
    """Problems of the optional run facts (:data:`OPTIONAL_KEYS`) that ``doc`` holds."""
    problems = []
    window = doc.get("window")
    if "window" in doc and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        problems.append(
            Mismatch("foreign_metadata", where, f"'window' must be an int >= 1, got {window!r}")
        )
    upgraded = doc.get("upgraded_from")
    if "upgraded_from" in doc and (not isinstance(upgraded, str) or not upgraded):
        problems.append(
            Mismatch(
                "foreign_metadata",
                where,
                f"'upgraded_from' must be a non-empty string, got {upgraded!r}",
            )
        )
    unrecorded = doc.get("unrecorded")
    if "unrecorded" in doc and (
        not isinstance(unrecorded, list) or any(c not in UNRECORDABLE_COLUMNS for c in unrecorded)
    ):
        problems.append(
            Mismatch(
                "foreign_metadata",
                where,
                f"'unrecorded' must be a list drawn from {list(UNRECORDABLE_COLUMNS)}, "
                f"got {unrecorded!r}",
            )
        )
    if "telemetry_cost" in doc:
        problem = cost_problem(doc["telemetry_cost"])
        if problem is not None:
            problems.append(Mismatch("foreign_metadata", where, problem))
    return problems


def version_problems(
    doc: Mapping[str, Any], expected: SchemaName
) -> tuple[tuple[int, int] | None, list[Mismatch]]:
    """Check a decoded ``ti`` object against schema ``expected``: its version and problems."""
    problems: list[Mismatch] = []
    where = "schema metadata 'ti'"
    for key in REQUIRED_KEYS:
        if not isinstance(doc.get(key), str) or not doc[key]:
            problems.append(
                Mismatch("foreign_metadata", where, f"needs a non-empty string {key!r}")
            )
    name = doc.get("schema")
    if isinstance(name, str) and name and name != expected:
        problems.append(
            Mismatch(
                "foreign_metadata",
                where,
                f"describes schema {name!r}, not {expected!r}"
                + (" (use the matching validate_* function)" if name in KNOWN_VERSIONS else ""),
            )
        )
    problems += _fact_problems(doc, where)
    raw_version = doc.get("schema_version")
    if not isinstance(raw_version, str) or not raw_version:
        return None, problems
    try:
        version = parse_version(raw_version)
    except ValueError as exc:
        problems.append(Mismatch("unsupported_version", where, str(exc)))
        return None, problems
    if version[0] != SCHEMA_MAJOR:
        known = ", ".join(KNOWN_VERSIONS.get(expected, (SCHEMA_VERSION,)))
        advice = (
            "upgrade ti-schema to a release that reads it"
            if version[0] > SCHEMA_MAJOR
            else "convert the data or read it with the older ti-schema that wrote it"
        )
        problems.append(
            Mismatch(
                "unsupported_version",
                where,
                f"{expected} {raw_version} cannot be read: this reader knows "
                f"{expected} {SCHEMA_MAJOR}.x ({known}); {advice}",
            )
        )
    return version, problems


def check_compatible(source: MetadataSource, expected: SchemaName = HISTORY) -> tuple[int, int]:
    """Decide from its ``ti`` metadata whether this reader may read ``source`` as ``expected``.

    Returns the data's ``(major, minor)``: any minor of this reader's major is accepted (a newer
    minor may only have added nullable columns, which the ``validate_*`` functions check).
    Raises :class:`SchemaMismatchError` for missing or foreign metadata and for another major.
    """
    expected = check_schema_name(expected, "check_compatible(expected)")
    doc, problems = read_metadata(source)
    version = None
    if doc is not None:
        version, more = version_problems(doc, expected)
        problems += more
    if problems or version is None:
        raise SchemaMismatchError(f"{expected} metadata", problems)
    return version
