"""One event as a ``ti.events`` record batch (the contract: ``ti_schema.events``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import pyarrow as pa

from ti_schema import EventKind, ReplayVerdict


@dataclass(frozen=True)
class Event:
    """What happened, where, and the dense capture it set off."""

    event_id: int
    kind: EventKind
    forward_index: int
    timestamp_us: int
    dense_first_forward: int
    dense_forwards: int
    signal: str | None = None
    layers: tuple[str, ...] = ()
    """Every flagged module, in execution order (the first is the event's ``layer``)."""
    module_types: tuple[str, ...] = ()
    tensor_paths: tuple[str, ...] = ()
    reason: str | None = None
    value: float | None = None
    replay: ReplayVerdict | None = None
    """The replay's verdict (replay mode's ``nonfinite`` events; contract 1.5)."""
    replay_reason: str | None = None

    @property
    def layer(self) -> str | None:
        """The first flagged module (None for manual and loss events)."""
        return self.layers[0] if self.layers else None


class EventDetails(TypedDict, total=False):
    """What an :class:`Event` says beyond its kind, forward and dense capture (its optional
    fields, as keyword arguments)."""

    signal: str | None
    layers: tuple[str, ...]
    module_types: tuple[str, ...]
    tensor_paths: tuple[str, ...]
    reason: str | None
    value: float | None
    replay: ReplayVerdict | None
    replay_reason: str | None


def event_batch(event: Event, schema: pa.Schema, run_id: str, rank: int) -> pa.RecordBatch:
    """``event`` as one row of ``schema`` (``ti_schema.events_schema(producer)``)."""
    first = bool(event.layers)
    columns: dict[str, list[object]] = {
        "run_id": [run_id],
        "rank": [rank],
        "event_id": [event.event_id],
        "kind": [event.kind],
        "forward_index": [event.forward_index],
        "timestamp": [event.timestamp_us],
        "signal": [event.signal],
        "layer": [event.layers[0] if first else None],
        "module_type": [event.module_types[0] if first else None],
        "tensor_path": [event.tensor_paths[0] if first else None],
        "layers": [list(event.layers)],
        "tensor_paths": [list(event.tensor_paths)],
        "reason": [event.reason],
        "value": [event.value],
        "dense_first_forward": [event.dense_first_forward],
        "dense_forwards": [event.dense_forwards],
        "replay": [event.replay],
        "replay_reason": [event.replay_reason],
    }
    arrays = [pa.array(columns[f.name], type=f.type) for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


__all__ = ["Event", "EventDetails", "event_batch"]
