"""Conformance kit for third-party producers, sinks and readers (pyarrow and stdlib only).

Each ``assert_*`` raises AssertionError listing every problem (the SchemaMismatchError is
chained), so it reads well in pytest. ``example_history_table`` and
``example_histogram_table`` build small valid tables for people writing readers, and
``example_run_info`` the RunInfo to open a sink with before feeding it those tables.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import pyarrow as pa

from ti_schema.artifacts import artifact_dir_problems
from ti_schema.errors import SchemaMismatchError
from ti_schema.layout import HISTOGRAMS_FILE, HISTORY_FILE, INDEX_FILE, RESULT_FILE
from ti_schema.names import (
    DEFAULT_METRICS,
    DEFAULT_SIGNALS,
    FINITE_METRICS,
    PARAMETER_SIGNALS,
    SIGNALS,
    Signal,
)
from ti_schema.result_json import load_strict_json, result_json_problems
from ti_schema.schemas import DICTIONARY_COLUMNS, histogram_schema, history_schema
from ti_schema.sink import LayerInfo, RunInfo
from ti_schema.validate import Nullability, validate_histograms, validate_history


def _fail(error: SchemaMismatchError) -> AssertionError:
    return AssertionError(str(error))


def assert_history_conforms(table: Any, *, nullability: Nullability = "schema") -> None:
    """Assert a table, batch or schema conforms to ``ti.history`` (see ``validate_history``)."""
    try:
        validate_history(table, nullability=nullability)
    except SchemaMismatchError as error:
        raise _fail(error) from error


def assert_histograms_conform(table: Any, *, nullability: Nullability = "schema") -> None:
    """Assert a table, batch or schema conforms to ``ti.histograms``."""
    try:
        validate_histograms(table, nullability=nullability)
    except SchemaMismatchError as error:
        raise _fail(error) from error


def assert_result_json_conforms(path_or_obj: str | os.PathLike[str] | Any) -> None:
    """Assert a result.json file (str or path) or its parsed content conforms."""
    if isinstance(path_or_obj, str | os.PathLike):
        try:
            data = load_strict_json(path_or_obj)
        except (OSError, ValueError) as exc:
            raise AssertionError(f"result.json at {path_or_obj} cannot be read: {exc}") from exc
    else:
        data = path_or_obj
    problems = result_json_problems(data)
    if problems:
        error = SchemaMismatchError("result.json", problems)
        raise _fail(error) from error


def assert_artifact_dir_conforms(path: str | os.PathLike[str], *, allow_live: bool = False) -> None:
    """Assert a run directory holds conforming artifacts (the checks of ``ti validate``).

    A run directory holds history.parquet, result.json and index.md (histograms.parquet and
    parts are checked when present). A directory of rank-private runs (``rank-000/``,
    ``rank-001/``...) is checked rank by rank, and each rank's rows must carry its own
    ``rank``. ``allow_live=True`` also accepts a run not consolidated yet (parts only).
    See :func:`ti_schema.artifacts.artifact_dir_problems`.
    """
    try:
        problems = artifact_dir_problems(path, allow_live=allow_live)
    except NotADirectoryError as exc:
        raise AssertionError(str(exc)) from exc
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise AssertionError(
            f"{Path(path)} does not conform ({len(problems)} problems):\n{listing}"
        )


_LAYERS: Final[tuple[tuple[str, str], ...]] = (
    ("encoder.0", "Linear"),
    ("encoder.1", "ReLU"),
    ("head", "Linear"),
)
_START: Final[datetime] = datetime(2026, 1, 1, tzinfo=UTC)


def example_run_info(
    *,
    producer: str = "ti-schema example",
    rank: int = 0,
    rank_subdir: str | None = None,
    metrics: Sequence[str] = DEFAULT_METRICS,
) -> RunInfo:
    """The :class:`~ti_schema.RunInfo` of the run the example tables describe, to open a sink
    with in tests: layers ``encoder.0`` (Linear), ``encoder.1`` (ReLU) and ``head`` (Linear),
    all three focus layers, run id ``example-run``."""
    return RunInfo(
        run_id="example-run",
        rank=rank,
        world_size=rank + 1,
        producer=producer,
        started_at=_START,
        layers=tuple(LayerInfo(name, module_type) for name, module_type in _LAYERS),
        focus_layers=tuple(name for name, _ in _LAYERS),
        metrics=tuple(metrics),
        sampler="EveryNForwardsSampler(n=2)",
        rank_subdir=rank_subdir,
        settings={"error_policy": "warn"},
    )


def _tensors(signals: Sequence[Signal] = DEFAULT_SIGNALS) -> Any:
    """Endless (sample, layer, module_type, signal, tensor_path) in the order a producer would
    emit them; the parameter signals cover the Linear layers' ``weight`` and ``bias``, and
    ``optimizer_state`` their three state tensors (``weight.exp_avg``, ...), ``attention`` one
    call per layer (``sdpa[0]``)."""
    unknown = [s for s in signals if s not in SIGNALS]
    if unknown or isinstance(signals, str) or not signals:
        raise ValueError(
            f"signals must be a non-empty sequence drawn from {SIGNALS}, got {signals!r}"
        )
    sample = 0
    while True:
        for signal in signals:
            for layer, module_type in _LAYERS:
                if signal == "optimizer_state":
                    if module_type == "Linear":
                        for name in ("weight", "bias"):
                            for part in ("exp_avg", "exp_avg_sq", "grad_sq_over_v"):
                                yield sample, layer, module_type, signal, f"{name}.{part}"
                elif signal == "attention":
                    yield sample, layer, module_type, signal, "sdpa[0]"
                elif signal == "input":
                    yield sample, layer, module_type, signal, "[0]"
                elif signal not in PARAMETER_SIGNALS:
                    yield sample, layer, module_type, signal, ""
                elif module_type == "Linear":
                    for path in ("weight", "bias"):
                        yield sample, layer, module_type, signal, path
        sample += 1


def example_history_table(
    rows: int = 54,
    *,
    producer: str = "ti-schema example",
    dictionary: bool = False,
    signals: Sequence[Signal] = DEFAULT_SIGNALS,
) -> pa.Table:
    """A valid synthetic ``ti.history`` table of ``rows`` rows (deterministic).

    Three layers (``encoder.0``, ``encoder.1``, ``head``), one signal after the other
    (``signals``, default outputs then their gradients; the parameter signals cover the two
    Linear layers' ``weight`` and ``bias``), the default metrics per tensor. The ReLU's gradient
    in samples 0, 3, 6... is an empty tensor, so its rows show unavailable values with a reason.
    ``dictionary=True`` dictionary-encodes the repeating string columns, as a producer may.
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    columns: dict[str, list[Any]] = {name: [] for name in history_schema().names}
    tensors = _tensors(signals)
    while len(columns["run_id"]) < rows:
        sample, layer, module_type, signal, path = next(tensors)
        gradient = signal in ("output_gradient", "parameter_gradient")
        empty = layer == "encoder.1" and gradient and sample % 3 == 0
        shape = [0, 4] if empty else [8, 4]
        if path:
            shape = [4, 4] if path == "weight" else [4]
        for index, metric in enumerate(DEFAULT_METRICS):
            if len(columns["run_id"]) == rows:
                break
            if empty:
                value, reason = None, "empty tensor"
            elif metric in FINITE_METRICS:
                value, reason = round(0.1 * (index + 1) + 0.01 * sample, 6), None
            else:
                value, reason = 0.0, None
            row = {
                "run_id": "example-run",
                "rank": 0,
                "sample_id": sample,
                "forward_index": 2 * sample,
                "timestamp": _START + timedelta(seconds=sample, milliseconds=int(gradient)),
                "layer": layer,
                "module_type": module_type,
                "call_index": 0,
                "signal": signal,
                "tensor_path": path,
                "mode": "train",
                "grad_enabled": True,
                "shape": shape,
                "dtype": "float32",
                "metric": metric,
                "value": value,
                "unavailable_reason": reason,
            }
            for name, item in row.items():
                columns[name].append(item)
    table = pa.table(columns, schema=history_schema(producer))
    return _encode(table) if dictionary else table


def example_histogram_table(
    rows: int = 6, *, producer: str = "ti-schema example", dictionary: bool = False
) -> pa.Table:
    """A valid synthetic ``ti.histograms`` table of ``rows`` rows (deterministic)."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    columns: dict[str, list[Any]] = {name: [] for name in histogram_schema().names}
    tensors = _tensors()
    for _ in range(rows):
        sample, layer, module_type, signal, _ = next(tensors)
        counts = [1 + sample, 2, 1]
        row = {
            "run_id": "example-run",
            "rank": 0,
            "sample_id": sample,
            "forward_index": 2 * sample,
            "timestamp": _START + timedelta(seconds=sample),
            "layer": layer,
            "module_type": module_type,
            "call_index": 0,
            "signal": signal,
            "tensor_path": "",
            "mode": "train",
            "grad_enabled": True,
            "shape": [sum(counts)],
            "dtype": "float32",
            "bucket_limits": [-1.0, 0.0, 1.0],
            "bucket_counts": counts,
            "min": -1.5,
            "max": 1.0,
            "num": sum(counts),
            "sum": -0.5,
            "sum_squares": 3.25,
            "nonfinite_count": 0,
        }
        for name, item in row.items():
            columns[name].append(item)
    table = pa.table(columns, schema=histogram_schema(producer))
    return _encode(table) if dictionary else table


def _encode(table: pa.Table) -> pa.Table:
    """Dictionary-encode the repeating string columns, keeping names, nullability and metadata."""
    for name in sorted(DICTIONARY_COLUMNS & set(table.column_names)):
        index = table.column_names.index(name)
        old = table.schema.field(index)
        encoded = table.column(index).dictionary_encode()
        table = table.set_column(index, old.with_type(encoded.type), encoded)
    return table


__all__ = [
    "HISTOGRAMS_FILE",
    "HISTORY_FILE",
    "INDEX_FILE",
    "RESULT_FILE",
    "assert_artifact_dir_conforms",
    "assert_histograms_conform",
    "assert_history_conforms",
    "assert_result_json_conforms",
    "example_histogram_table",
    "example_history_table",
    "example_run_info",
    "load_strict_json",
]
