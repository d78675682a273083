"""The contract between capture and storage: what a sink is told and what it receives.

Ownership: the observer opens every sink it was given during ``inject_observer`` and closes each
exactly once during ``remove_observer``. A sink that wraps a caller-owned object (a logger, a
writer) flushes it on ``close`` but never closes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, runtime_checkable

import pyarrow as pa


@dataclass(frozen=True)
class LayerInfo:
    """One selected module: its qualified name, class name and other names of the same object."""

    name: str
    module_type: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunInfo:
    """Facts about one observed run, fixed at attach time and handed to ``Sink.open``."""

    run_id: str
    rank: int
    world_size: int
    producer: str
    """``"<distribution> <version>"`` written into the ``ti`` schema metadata."""
    started_at: datetime
    layers: tuple[LayerInfo, ...]
    """Every selected module in traversal order, executed or not."""
    focus_layers: tuple[str, ...]
    """Layers whose tensors also get histograms."""
    metrics: tuple[str, ...]
    """Metric names every measured tensor reports, in emission order."""
    sampler: str
    """Human description of the sampler, e.g. ``TimedSampler(interval=60s)``."""
    rank_subdir: str | None = None
    """Rank-private subdirectory (e.g. ``rank-001``) that file sinks write under, or None."""
    settings: Mapping[str, str] = field(default_factory=dict)
    """Other attach-time settings worth recording (error policy, capture mode, ...)."""


@runtime_checkable
class Sink(Protocol):
    """Receives columnar records from the observer.

    ``write_history`` batches conform to ``ti_schema.history_schema()``; ``write_histograms``
    batches to ``ti_schema.histogram_schema()``. Both are called on the training thread (or the
    thread that ran backward) and must return quickly: slow work belongs on the sink's own worker.

    Optional, for sinks whose writes are thread-safe: a class attribute
    ``accepts_background_writes = True`` lets the observer reduce and write from its emission
    worker thread instead (when every sink of the run says so; see ``inject_observer``), and a
    method ``attach_barrier(barrier)`` receives a callable that waits for the signals the
    observer has queued: call it before serving reads that must include them.
    """

    def open(self, run: RunInfo) -> None:
        """Prepare to receive this run's records; raise here for bad settings or paths."""
        ...

    def write_history(self, batch: pa.RecordBatch) -> None:
        """Accept one batch of ``ti.history`` rows."""
        ...

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        """Accept one batch of ``ti.histograms`` rows."""
        ...

    def close(self) -> None:
        """Finish the run: flush and finalize. Called once, at removal."""
        ...
