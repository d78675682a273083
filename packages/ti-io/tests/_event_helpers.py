"""``ti.events`` batches for sink-level tests, built with ``ti_schema.events_schema()``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa

from ti_schema import events_schema

PRODUCER = "ti-io tests"
START = datetime(2026, 1, 1, tzinfo=UTC)


def event_batch(
    event_id: int,
    *,
    kind: str = "nonfinite",
    forward_index: int = 10,
    rank: int = 0,
    run_id: str = "run-1",
    signal: str | None = "output",
    layers: tuple[str, ...] = ("encoder.1", "encoder.0"),
    types: tuple[str, ...] = ("ReLU", "Linear"),
    tensor_paths: tuple[str, ...] | None = None,
    reason: str | None = None,
    value: float | None = None,
    dense_forwards: int = 4,
    seconds: float = 0.0,
    replay: str | None = None,
    replay_reason: str | None = None,
) -> pa.RecordBatch:
    """One event row. A nonfinite event names ``layers[0]`` as its first module; manual and
    loss events have no module."""
    nonfinite = kind == "nonfinite"
    paths = tensor_paths if tensor_paths is not None else tuple("" for _ in layers)
    row: dict[str, Any] = {
        "run_id": run_id,
        "rank": rank,
        "event_id": event_id,
        "kind": kind,
        "forward_index": forward_index,
        "timestamp": START + timedelta(seconds=seconds),
        "signal": signal if nonfinite else None,
        "layer": layers[0] if nonfinite else None,
        "module_type": types[0] if nonfinite else None,
        "tensor_path": paths[0] if nonfinite else None,
        "layers": list(layers) if nonfinite else [],
        "tensor_paths": list(paths) if nonfinite else [],
        "reason": reason,
        "value": value,
        "dense_first_forward": forward_index + 1,
        "dense_forwards": dense_forwards,
        "replay": replay if nonfinite else None,
        "replay_reason": replay_reason if nonfinite else None,
    }
    schema = events_schema(PRODUCER)
    return pa.table({k: [v] for k, v in row.items()}, schema=schema).to_batches()[0]
