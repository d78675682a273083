"""The ``ti.events`` table (contract 1.3): when training broke, and the captures that followed.

One row per event. An event is rare and urgent: ti-core hands each to the sinks as it happens
(ti-io publishes it as a part of its own at once) and a run without events has an empty table.
Kinds (:data:`EVENT_KINDS`):

- ``nonfinite``: the sentinel found a NaN or an infinity in a selected module's output
  (``signal`` ``output``) or in the gradient flowing back into one (``output_gradient``);
  ``layer`` / ``module_type`` / ``tensor_path`` name the first such module in execution order
  (call order in the forward; arrival order in the backward) and ``layers`` / ``tensor_paths``
  every one flagged in that root forward, in that order.
- ``manual``: the training loop asked for a capture (``ti_core.trigger_capture``); ``reason``
  says why.
- ``loss``: a trainer callback saw the loss go non-finite or spike; ``value`` is that loss.

A ``nonfinite`` event of the sentinel's replay mode (contract 1.5) carries the verdict of
replaying its step (:data:`REPLAY_VERDICTS`, column ``replay``; why, in ``replay_reason``):
``reproduced`` (real numerics: ``layer`` names the first module that made the non-finite value,
or the root when it came in with the batch), ``not_reproduced`` (the step's own result was not
finite but the replay is clean: a transient fault of the device or a non-deterministic
kernel), ``from_another_rank`` (the replay of this rank's own computation is clean while its
gradients, reduced across ranks, were not) or ``not_replayable`` (why not). Null for manual and
loss events, for the dense mode's, and in files of contract 1.3 and 1.4.

Every event asks for a dense capture: the ``dense_forwards`` root forwards from
``dense_first_forward`` on are sampled whatever the sampler says. Their history rows are the
ones whose ``forward_index`` lies in that range on the event's rank (docs/data-contract.md has
the query). Validated by :func:`ti_schema.validate_events`.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

import pyarrow as pa

from ti_schema.schemas import EVENTS, schema_metadata

EventKind = Literal["nonfinite", "manual", "loss"]
EVENT_KINDS: Final[tuple[EventKind, ...]] = get_args(EventKind)
"""Every value of the ``kind`` column."""

EVENT_SIGNALS: Final[tuple[str, ...]] = ("output", "output_gradient")
"""What a ``nonfinite`` event's ``signal`` may say (null for the other kinds)."""

ReplayVerdict = Literal["reproduced", "not_reproduced", "from_another_rank", "not_replayable"]
REPLAY_VERDICTS: Final[tuple[ReplayVerdict, ...]] = get_args(ReplayVerdict)
"""Every value of the ``replay`` column (contract 1.5; null where no replay ran)."""

# (name, type, nullable, one-line doc)
_EVENT_COLUMNS: Final[tuple[tuple[str, pa.DataType, bool, str], ...]] = (
    ("run_id", pa.string(), False, "one id per inject_observer call"),
    ("rank", pa.int32(), False, "global rank of the process the event happened in"),
    ("event_id", pa.int64(), False, "0-based counter of events in this run and rank"),
    ("kind", pa.string(), False, "'nonfinite', 'manual' or 'loss'"),
    (
        "forward_index",
        pa.int64(),
        False,
        "the root forward the event belongs to: whose output or gradient was non-finite, or "
        "the latest root forward started when a capture was asked for (-1 before the first)",
    ),
    ("timestamp", pa.timestamp("us", tz="UTC"), False, "when the event was detected"),
    (
        "signal",
        pa.string(),
        True,
        "nonfinite: 'output' or 'output_gradient', the check that fired (replay mode: the "
        "root's output, or the gradients checked when a backward ended); else null",
    ),
    (
        "layer",
        pa.string(),
        True,
        "nonfinite: the first module the replay names, else the first flagged module in "
        "execution order ('' is the root); else null",
    ),
    ("module_type", pa.string(), True, "class name of that module; null with layer"),
    ("tensor_path", pa.string(), True, "that module's first non-finite tensor; null with layer"),
    (
        "layers",
        pa.list_(pa.string()),
        False,
        "every module named (the replay's, else every flagged module of that root forward, in "
        "execution order, one entry per flagged call); empty for manual and loss events",
    ),
    (
        "tensor_paths",
        pa.list_(pa.string()),
        False,
        "the non-finite tensor of each entry of layers, position by position",
    ),
    ("reason", pa.string(), True, "manual and loss: why the capture was asked for"),
    ("value", pa.float64(), True, "loss: the loss value that set it off; else null"),
    (
        "dense_first_forward",
        pa.int64(),
        False,
        "the first root forward of the dense capture the event set off",
    ),
    (
        "dense_forwards",
        pa.int32(),
        False,
        "root forwards sampled in full from dense_first_forward on (fewer when the run ended)",
    ),
    (
        "replay",
        pa.string(),
        True,
        "nonfinite, replay mode: 'reproduced', 'not_reproduced', 'from_another_rank' or "
        "'not_replayable' (contract 1.5); null for other events",
    ),
    (
        "replay_reason",
        pa.string(),
        True,
        "what the replay found, in words (which tensor, which rank and device, why not "
        "replayable); null with replay",
    ),
)
"""Columns added after 1.3 come last, with the minor that added them in :data:`ADDED_IN`."""

ADDED_IN: Final[dict[str, int]] = {"replay": 5, "replay_reason": 5}
"""The contract minor that added each ``ti.events`` column after the table's own (1.3)."""

EVENT_COLUMNS: Final[tuple[str, ...]] = tuple(c[0] for c in _EVENT_COLUMNS)


def events_schema(producer: str | None = None) -> pa.Schema:
    """The ``ti.events`` schema: one row per event."""
    fields = [
        pa.field(name, typ, nullable=nullable, metadata={b"doc": doc.encode()})
        for name, typ, nullable, doc in _EVENT_COLUMNS
    ]
    return pa.schema(fields, metadata=schema_metadata(EVENTS, producer))


def empty_events(producer: str | None = None) -> pa.Table:
    """A ``ti.events`` table with no rows (a run without events has this, not a missing file)."""
    return events_schema(producer).empty_table()


__all__ = [
    "ADDED_IN",
    "EVENT_COLUMNS",
    "EVENT_KINDS",
    "EVENT_SIGNALS",
    "REPLAY_VERDICTS",
    "EventKind",
    "ReplayVerdict",
    "empty_events",
    "events_schema",
]
