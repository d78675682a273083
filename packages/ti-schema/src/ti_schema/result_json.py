"""result.json: its JSON Schema (draft 2020-12) and a dependency-free validator.

result.json is a JSON array of layer records; each lists the measured tensors of the layer with
per-metric aggregates of the per-sample values and, from contract 1.3 and only when there are
any, the ``events`` (``ti.events``) whose first flagged module it is. Strict JSON: no NaN or
Infinity, and every null aggregate carries an ``unavailable_reason``. Described in
docs/data-contract.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Final

from ti_schema.errors import Mismatch, SchemaMismatchError
from ti_schema.events import EVENT_KINDS, EVENT_SIGNALS, REPLAY_VERDICTS
from ti_schema.names import MODES
from ti_schema.signals import SIGNAL_DECLARATION, SignalDeclaration
from ti_schema.version import SCHEMA_VERSION

RESULT_JSON: Final[str] = "result.json"

LAYER_KEYS: Final[tuple[str, ...]] = ("layer", "type", "aliases", "tensors")
OPTIONAL_LAYER_KEYS: Final[tuple[str, ...]] = ("events",)
"""Keys a layer record may have (contract 1.3): ``events``, written only when non-empty."""
EVENT_KEYS: Final[tuple[str, ...]] = (
    "kind",
    "forward_index",
    "signal",
    "layer",
    "module_type",
    "tensor_path",
    "layers",
    "rank",
    "timestamp",
    "reason",
    "value",
    "dense_first_forward",
    "dense_forwards",
)
"""The keys of an event object (a ``ti.events`` row without its ids and ``tensor_paths``)."""
OPTIONAL_EVENT_KEYS: Final[tuple[str, ...]] = ("replay", "replay_reason")
"""Keys an event object may have (contract 1.5: the replay's verdict)."""
TENSOR_KEYS: Final[tuple[str, ...]] = (
    "call_index",
    "signal",
    "tensor_path",
    "mode",
    "grad_enabled",
    "latest_shape",
    "dtype",
    "statistics",
)
COUNT_KEYS: Final[tuple[str, ...]] = ("observations", "unavailable")
AGGREGATE_KEYS: Final[tuple[str, ...]] = (
    "mean",
    "std",
    "min",
    "p25",
    "p50",
    "p75",
    "max",
    "previous_window_mean",
    "recent_window_mean",
)
STATISTIC_KEYS: Final[tuple[str, ...]] = (*COUNT_KEYS, *AGGREGATE_KEYS, "unavailable_reason")

_COUNT: Final[dict[str, Any]] = {"type": "integer", "minimum": 0}
_NULLABLE_STRING: Final[dict[str, Any]] = {"type": ["string", "null"]}


def result_json_schema(signals: SignalDeclaration = SIGNAL_DECLARATION) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of result.json whose ``signal`` values are ``signals``'."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "TorchInstruments result.json",
        "description": (
            f"Per-layer aggregates of ti.history {SCHEMA_VERSION}: one record per selected layer, "
            "executed or not. Aggregates weigh every sample equally; a null aggregate carries a "
            "reason."
        ),
        "type": "array",
        "items": {"$ref": "#/$defs/layer"},
        "$defs": {
            "layer": {
                "type": "object",
                "additionalProperties": False,
                "required": list(LAYER_KEYS),
                "properties": {
                    "layer": {"type": "string", "description": "qualified name ('' is the root)"},
                    "type": {"type": "string", "description": "class name of the module"},
                    "aliases": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "other qualified names of the same module",
                    },
                    "tensors": {"type": "array", "items": {"$ref": "#/$defs/tensor"}},
                    "events": {
                        "type": "array",
                        "items": {"$ref": "#/$defs/event"},
                        "description": "events whose first flagged module this layer is "
                        "(contract 1.3; present only when there are any)",
                    },
                },
            },
            "event": {
                "type": "object",
                "additionalProperties": False,
                "required": list(EVENT_KEYS),
                "properties": {
                    "kind": {"enum": list(EVENT_KINDS)},
                    "forward_index": {"type": "integer", "minimum": -1},
                    "signal": {"enum": [*EVENT_SIGNALS, None]},
                    "layer": _NULLABLE_STRING,
                    "module_type": _NULLABLE_STRING,
                    "tensor_path": _NULLABLE_STRING,
                    "layers": {"type": "array", "items": {"type": "string"}},
                    "rank": _COUNT,
                    "timestamp": {"type": "string", "description": "ISO 8601, UTC"},
                    "reason": _NULLABLE_STRING,
                    "value": {"type": ["number", "null"]},
                    "dense_first_forward": {"type": "integer"},
                    "dense_forwards": _COUNT,
                    "replay": {"enum": [*REPLAY_VERDICTS, None]},
                    "replay_reason": _NULLABLE_STRING,
                },
            },
            "tensor": {
                "type": "object",
                "additionalProperties": False,
                "required": list(TENSOR_KEYS),
                "properties": {
                    "call_index": _COUNT,
                    "signal": {"enum": list(signals.names)},
                    "tensor_path": {"type": "string"},
                    "mode": {"enum": list(MODES)},
                    "grad_enabled": {"type": "boolean"},
                    "latest_shape": {"type": "array", "items": _COUNT},
                    "dtype": {"type": "string"},
                    "statistics": {
                        "type": "object",
                        "propertyNames": {"minLength": 1},
                        "additionalProperties": {"$ref": "#/$defs/statistic"},
                        "description": "keyed by metric name",
                    },
                },
            },
            "statistic": {
                "type": "object",
                "additionalProperties": False,
                "required": list(STATISTIC_KEYS),
                "properties": {
                    **{key: _COUNT for key in COUNT_KEYS},
                    **{key: {"type": ["number", "null"]} for key in AGGREGATE_KEYS},
                    "unavailable_reason": {"type": ["string", "null"]},
                },
                "allOf": [
                    {
                        "if": {"properties": {key: {"type": "null"}}, "required": [key]},
                        "then": {"properties": {"unavailable_reason": {"type": "string"}}},
                    }
                    for key in AGGREGATE_KEYS
                ],
            },
        },
    }


RESULT_JSON_SCHEMA: Final[dict[str, Any]] = result_json_schema()
"""JSON Schema (draft 2020-12) of result.json; :func:`validate_result_json` checks the same."""

_IDENTIFIER: Final[re.Pattern[str]] = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if _IDENTIFIER.fullmatch(key) else f"{path}[{key!r}]"


def _kind(value: Any) -> str:
    names = {type(None): "null", bool: "boolean", str: "string", list: "array", dict: "object"}
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "number"
    return names.get(type(value), type(value).__name__)


class _Walker:
    def __init__(self, signals: SignalDeclaration) -> None:
        self.problems: list[Mismatch] = []
        self.signals = signals.names

    def add(self, path: str, message: str) -> None:
        self.problems.append(Mismatch("json", path, message))

    def strict(self, value: Any, path: str) -> None:
        """Reject what strict JSON cannot hold, wherever it sits."""
        if isinstance(value, float) and not math.isfinite(value):
            self.add(path, f"is {value!r}; strict JSON has no NaN or Infinity (write null)")
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    self.add(path, f"has a non-string key {key!r}")
                else:
                    self.strict(item, _key_path(path, key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                self.strict(item, f"{path}[{i}]")
        elif not isinstance(value, str | int | float | type(None)):
            self.add(path, f"holds a {type(value).__name__}, which is not a JSON value")

    def obj(
        self, value: Any, path: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.add(path, f"expected an object with {list(keys)}, got {_kind(value)}")
            return None
        for key in keys:
            if key not in value:
                self.add(_key_path(path, key), "is missing")
        for key in value:
            if isinstance(key, str) and key not in keys and key not in optional:
                self.add(_key_path(path, key), "is not part of result.json")
        return value

    def array(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            self.add(path, f"expected an array, got {_kind(value)}")
            return []
        return value

    def string(
        self, parent: dict[str, Any], key: str, path: str, *, nullable: bool = False
    ) -> None:
        if key in parent and not (
            isinstance(parent[key], str) or (nullable and parent[key] is None)
        ):
            kind = "a string or null" if nullable else "a string"
            self.add(_key_path(path, key), f"expected {kind}, got {_kind(parent[key])}")

    def count(self, value: Any, path: str) -> None:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value != int(value) or value < 0:
            self.add(path, f"expected a non-negative integer, got {value!r}")

    def enum(self, parent: dict[str, Any], key: str, path: str, allowed: tuple[str, ...]) -> None:
        if key in parent and parent[key] not in allowed:
            self.add(_key_path(path, key), f"is {parent[key]!r}; allowed: {list(allowed)!r}")

    def layer(self, value: Any, path: str) -> None:
        record = self.obj(value, path, LAYER_KEYS, OPTIONAL_LAYER_KEYS)
        if record is None:
            return
        if "events" in record:
            events_path = _key_path(path, "events")
            for i, event in enumerate(self.array(record["events"], events_path)):
                self.event(event, f"{events_path}[{i}]")
        self.string(record, "layer", path)
        self.string(record, "type", path)
        if "aliases" in record:
            aliases_path = _key_path(path, "aliases")
            for i, alias in enumerate(self.array(record["aliases"], aliases_path)):
                if not isinstance(alias, str):
                    self.add(f"{aliases_path}[{i}]", f"expected a string, got {_kind(alias)}")
        if "tensors" in record:
            tensors_path = _key_path(path, "tensors")
            for i, tensor in enumerate(self.array(record["tensors"], tensors_path)):
                self.tensor(tensor, f"{tensors_path}[{i}]")

    def integer(self, value: Any, path: str, minimum: int | None) -> None:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or (minimum is not None and value < minimum):
            floor = f" >= {minimum}" if minimum is not None else ""
            self.add(path, f"expected an integer{floor}, got {value!r}")

    def event(self, value: Any, path: str) -> None:
        record = self.obj(value, path, EVENT_KEYS, OPTIONAL_EVENT_KEYS)
        if record is None:
            return
        self.enum(record, "kind", path, EVENT_KINDS)
        if "signal" in record and record["signal"] is not None:
            self.enum(record, "signal", path, EVENT_SIGNALS)
        if record.get("replay") is not None:
            self.enum(record, "replay", path, REPLAY_VERDICTS)
        for key in ("layer", "module_type", "tensor_path", "reason", "replay_reason"):
            self.string(record, key, path, nullable=True)
        self.string(record, "timestamp", path)
        for key, minimum in (
            ("forward_index", -1),
            ("rank", 0),
            ("dense_first_forward", None),
            ("dense_forwards", 0),
        ):
            if key in record:
                self.integer(record[key], _key_path(path, key), minimum)
        if "layers" in record:
            layers_path = _key_path(path, "layers")
            for i, name in enumerate(self.array(record["layers"], layers_path)):
                if not isinstance(name, str):
                    self.add(f"{layers_path}[{i}]", f"expected a string, got {_kind(name)}")
        item = record.get("value")
        if item is not None and (not isinstance(item, int | float) or isinstance(item, bool)):
            self.add(_key_path(path, "value"), f"expected a number or null, got {_kind(item)}")

    def tensor(self, value: Any, path: str) -> None:
        record = self.obj(value, path, TENSOR_KEYS)
        if record is None:
            return
        if "call_index" in record:
            self.count(record["call_index"], _key_path(path, "call_index"))
        self.enum(record, "signal", path, self.signals)
        self.enum(record, "mode", path, MODES)
        self.string(record, "tensor_path", path)
        self.string(record, "dtype", path)
        if "grad_enabled" in record and not isinstance(record["grad_enabled"], bool):
            self.add(
                _key_path(path, "grad_enabled"),
                f"expected a boolean, got {_kind(record['grad_enabled'])}",
            )
        if "latest_shape" in record:
            shape_path = _key_path(path, "latest_shape")
            for i, size in enumerate(self.array(record["latest_shape"], shape_path)):
                self.count(size, f"{shape_path}[{i}]")
        if "statistics" in record:
            stats_path = _key_path(path, "statistics")
            stats = record["statistics"]
            if not isinstance(stats, dict):
                self.add(stats_path, f"expected an object keyed by metric, got {_kind(stats)}")
                return
            for metric, stat in stats.items():
                if isinstance(metric, str):
                    if not metric:
                        self.add(stats_path, "has an empty metric name")
                    self.statistic(stat, _key_path(stats_path, metric))

    def statistic(self, value: Any, path: str) -> None:
        record = self.obj(value, path, STATISTIC_KEYS)
        if record is None:
            return
        for key in COUNT_KEYS:
            if key in record:
                self.count(record[key], _key_path(path, key))
        self.string(record, "unavailable_reason", path, nullable=True)
        null_aggregates = []
        for key in AGGREGATE_KEYS:
            if key not in record:
                continue
            item = record[key]
            if item is None:
                null_aggregates.append(key)
            elif not isinstance(item, int | float) or isinstance(item, bool):
                self.add(_key_path(path, key), f"expected a number or null, got {_kind(item)}")
        if null_aggregates and not isinstance(record.get("unavailable_reason"), str):
            self.add(
                _key_path(path, "unavailable_reason"),
                f"must be a string: {null_aggregates} are null and a null aggregate carries a "
                "reason",
            )


def _no_constants(token: str) -> Any:
    raise ValueError(f"{token} is not strict JSON (write null with an unavailable_reason)")


def load_strict_json(path: str | os.PathLike[str]) -> Any:
    """Parse a JSON file, refusing the NaN/Infinity tokens Python's json module accepts."""
    return json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=_no_constants)


def result_json_problems(
    data: Any, signals: SignalDeclaration = SIGNAL_DECLARATION
) -> list[Mismatch]:
    """Every way ``data`` (parsed result.json) breaks the contract; empty when it conforms."""
    walker = _Walker(signals)
    walker.strict(data, "$")
    if isinstance(data, str | bytes):
        walker.add(
            "$",
            "got text, not parsed JSON: pass json.loads(text), or a path to "
            "ti_schema.testing.assert_result_json_conforms",
        )
        return walker.problems
    for i, layer in enumerate(walker.array(data, "$")):
        walker.layer(layer, f"$[{i}]")
    return walker.problems


def validate_result_json(data: Any, *, signals: SignalDeclaration = SIGNAL_DECLARATION) -> None:
    """Raise :class:`SchemaMismatchError` listing, by JSON path, every problem of ``data``.

    ``data`` is the parsed content of result.json (``json.load``). Checks what
    :data:`RESULT_JSON_SCHEMA` says (:func:`result_json_schema` of ``signals``), plus strict
    JSON: float NaN/Infinity anywhere is refused.
    """
    problems = result_json_problems(data, signals)
    if problems:
        raise SchemaMismatchError(RESULT_JSON, problems)
