"""The Arrow schemas of the contract, ``ti.history`` and ``ti.histograms`` (docs/data-contract.md).

Each column has a one-line doc in its field metadata; the ``ti`` schema metadata names the schema,
the contract version and the producer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import metadata
from typing import Final, Literal, get_args

import pyarrow as pa

from ti_schema.cost import RunCost
from ti_schema.signals import SIGNAL_DECLARATION, SignalDeclaration
from ti_schema.version import SCHEMA_VERSION

METADATA_KEY: Final[bytes] = b"ti"
"""The single schema-metadata key; its value is JSON ``{schema, schema_version, producer}`` plus
the optional run facts of schema 1.1 (``window``, ``upgraded_from``, ``unrecorded``) and 1.4
(``telemetry_cost``)."""

SchemaName = Literal["ti.history", "ti.histograms", "ti.events"]
"""The name of a contract schema, as the ``schema`` key of the ``ti`` metadata says it."""

HISTORY: Final = "ti.history"
HISTOGRAMS: Final = "ti.histograms"
EVENTS: Final = "ti.events"
SCHEMA_NAMES: Final[tuple[SchemaName, ...]] = get_args(SchemaName)


def check_schema_name(name: object, argument: str) -> SchemaName:
    """``name`` when it names a contract schema; else a ValueError naming ``argument``."""
    for known in SCHEMA_NAMES:
        if name == known:
            return known
    raise ValueError(f"{argument} must be one of {list(SCHEMA_NAMES)}, got {name!r}")


# (name, type, nullable, one-line doc). The identity columns are shared by both schemas.
_IDENTITY: Final[tuple[tuple[str, pa.DataType, bool, str], ...]] = (
    ("run_id", pa.string(), False, "one id per inject_observer call"),
    ("rank", pa.int32(), False, "global rank of the writing process; 0 when not distributed"),
    ("sample_id", pa.int64(), False, "0-based counter of sampled root forwards in this run"),
    (
        "forward_index",
        pa.int64(),
        False,
        "0-based index of the sampled root forward among all root forwards",
    ),
    (
        "timestamp",
        pa.timestamp("us", tz="UTC"),
        False,
        "when the tensor was observed: forward time for outputs and parameters, backward time"
        " for gradients, step time for parameter updates",
    ),
    ("layer", pa.string(), False, "qualified name from named_modules(); '' is the root"),
    ("module_type", pa.string(), False, "class name of the module"),
    (
        "call_index",
        pa.int32(),
        False,
        "0-based order of this module's calls within the sample (shared modules); 0 for the"
        " parameter signals",
    ),
    ("signal", pa.string(), False, ""),  # doc: the declared signals (_signal_doc)
    (
        "tensor_path",
        pa.string(),
        False,
        "output signals: position of the tensor in the output pytree, '' for a bare tensor,"
        " else e.g. [0] or ['logits']; parameter signals: the parameter's name in the module,"
        " e.g. weight; a DTensor part adds its placements (weight@S(0), @S(1)#0,1:"
        " ti_schema.placements)",
    ),
    ("mode", pa.string(), False, "'train' or 'eval': the module's own training flag at the call"),
    (
        "grad_enabled",
        pa.bool_(),
        False,
        "torch.is_grad_enabled() at the call; gradients inherit their forward's context",
    ),
    (
        "shape",
        pa.list_(pa.int64()),
        False,
        "tensor shape (of this rank's local shard for a DTensor parameter)",
    ),
    ("dtype", pa.string(), False, "torch dtype name without prefix, e.g. float32"),
)

_HISTORY_VALUES: Final[tuple[tuple[str, pa.DataType, bool, str], ...]] = (
    ("metric", pa.string(), False, "metric name, e.g. mean, p50, zero_fraction"),
    ("value", pa.float64(), True, "the measurement; null exactly when unavailable"),
    (
        "unavailable_reason",
        pa.string(),
        True,
        "why value is null; null exactly when value is not",
    ),
)

_HISTOGRAM_VALUES: Final[tuple[tuple[str, pa.DataType, bool, str], ...]] = (
    (
        "bucket_limits",
        pa.list_(pa.float64()),
        False,
        "right edge of each bucket, ascending (TensorBoard's bucket_limit)",
    ),
    ("bucket_counts", pa.list_(pa.int64()), False, "finite entries in each bucket"),
    ("min", pa.float64(), True, "smallest finite entry; null when there is none"),
    ("max", pa.float64(), True, "largest finite entry; null when there is none"),
    ("num", pa.int64(), False, "number of finite entries"),
    ("sum", pa.float64(), False, "sum of the finite entries"),
    ("sum_squares", pa.float64(), False, "sum of squares of the finite entries"),
    ("nonfinite_count", pa.int64(), False, "NaN and infinite entries left out of the buckets"),
)

DICTIONARY_COLUMNS: Final[frozenset[str]] = frozenset(
    {"layer", "module_type", "signal", "mode", "dtype", "metric"}
)
"""String columns that may be dictionary-encoded; readers accept both encodings."""


def default_producer() -> str:
    """``"<distribution> <version>"`` of this package, used when a producer names none."""
    try:
        return f"ti-schema {metadata.version('ti-schema')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
        return "ti-schema unknown"


UNRECORDABLE_COLUMNS: Final[tuple[str, ...]] = (
    "run_id",
    "rank",
    "mode",
    "grad_enabled",
    "module_type",
)
"""Identity columns a producer may list in the ``unrecorded`` metadata key (schema 1.1): data
converted from a producer that never recorded them (``ti upgrade`` of a torchinstruments 0.8.0
run) holds :data:`PLACEHOLDERS` there instead of measurements."""

PLACEHOLDERS: Final[dict[str, object]] = {
    "rank": 0,
    "mode": "train",
    "grad_enabled": True,
    "module_type": "",
}
"""The value an ``unrecorded`` column holds in every row (``run_id`` is chosen by the producer,
one per converted run). They carry no information: filter on them only knowing that."""


def schema_metadata(
    schema_name: SchemaName,
    producer: str | None = None,
    *,
    window: int | None = None,
    upgraded_from: str | None = None,
    unrecorded: Sequence[str] = (),
    telemetry_cost: RunCost | None = None,
) -> dict[bytes, bytes]:
    """The ``ti`` schema-metadata entry for ``schema_name`` written by ``producer``.

    Optional run facts (schema 1.1, written only when given): ``window``, the observations per
    window of result.json's window means; ``upgraded_from``, the producer whose artifacts this
    data was converted from; ``unrecorded``, the :data:`UNRECORDABLE_COLUMNS` that producer
    never recorded (they hold :data:`PLACEHOLDERS`); ``telemetry_cost`` (1.4), the run's
    measured telemetry cost (:class:`~ti_schema.cost.RunCost`).
    """
    doc: dict[str, object] = {
        "schema": check_schema_name(schema_name, "schema_metadata(schema_name)"),
        "schema_version": SCHEMA_VERSION,
        "producer": producer or default_producer(),
    }
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window= must be a positive int, got {window!r}")
        doc["window"] = window
    if upgraded_from is not None:
        if not isinstance(upgraded_from, str) or not upgraded_from:
            raise ValueError(f"upgraded_from= must be a non-empty string, got {upgraded_from!r}")
        doc["upgraded_from"] = upgraded_from
    if unrecorded:
        unknown = [c for c in unrecorded if c not in UNRECORDABLE_COLUMNS]
        if unknown or isinstance(unrecorded, str):
            raise ValueError(
                f"unrecorded= lists {unknown or unrecorded!r}; only {list(UNRECORDABLE_COLUMNS)} "
                "may be marked unrecorded"
            )
        doc["unrecorded"] = [c for c in UNRECORDABLE_COLUMNS if c in unrecorded]
    if telemetry_cost is not None:
        if not isinstance(telemetry_cost, RunCost):
            raise TypeError(f"telemetry_cost= must be a ti_schema.RunCost, got {telemetry_cost!r}")
        doc["telemetry_cost"] = telemetry_cost.to_doc()
    return {METADATA_KEY: json.dumps(doc, separators=(",", ":")).encode()}


def _signal_doc(signals: SignalDeclaration) -> str:
    """The ``signal`` column's doc: its allowed values, from the declaration."""
    quoted = [f"'{name}'" for name in signals.names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _build(
    columns: tuple[tuple[str, pa.DataType, bool, str], ...],
    metadata: dict[bytes, bytes],
    signals: SignalDeclaration,
) -> pa.Schema:
    fields = [
        pa.field(
            col,
            typ,
            nullable=nullable,
            metadata={b"doc": (_signal_doc(signals) if col == "signal" else doc).encode()},
        )
        for col, typ, nullable, doc in columns
    ]
    return pa.schema(fields, metadata=metadata)


def history_schema(
    producer: str | None = None,
    *,
    window: int | None = None,
    upgraded_from: str | None = None,
    unrecorded: Sequence[str] = (),
    signals: SignalDeclaration = SIGNAL_DECLARATION,
    telemetry_cost: RunCost | None = None,
) -> pa.Schema:
    """The ``ti.history`` schema: one row per scalar measurement.

    The keyword-only run facts go into the ``ti`` metadata (see :func:`schema_metadata`);
    ``signals``: the declaration whose values the ``signal`` column's doc lists.
    """
    meta = schema_metadata(
        HISTORY,
        producer,
        window=window,
        upgraded_from=upgraded_from,
        unrecorded=unrecorded,
        telemetry_cost=telemetry_cost,
    )
    return _build(_IDENTITY + _HISTORY_VALUES, meta, signals)


def histogram_schema(
    producer: str | None = None,
    *,
    window: int | None = None,
    upgraded_from: str | None = None,
    unrecorded: Sequence[str] = (),
    signals: SignalDeclaration = SIGNAL_DECLARATION,
) -> pa.Schema:
    """The ``ti.histograms`` schema: one row per histogram of a focus-layer tensor."""
    meta = schema_metadata(
        HISTOGRAMS, producer, window=window, upgraded_from=upgraded_from, unrecorded=unrecorded
    )
    return _build(_IDENTITY + _HISTOGRAM_VALUES, meta, signals)


IDENTITY_COLUMNS: Final[tuple[str, ...]] = tuple(c[0] for c in _IDENTITY)
"""Columns that identify one measured tensor, shared by both schemas."""
