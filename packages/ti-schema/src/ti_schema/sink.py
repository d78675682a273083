"""The producer/sink contract: what a sink is told, what it receives, what it may declare.

Pure Python and pyarrow, so a sink (ti-io's, or your own) implements it without torch; ti-core
re-exports every name (``ti_core.Sink``, ``ti_core.RunInfo``, ...), which are the same objects.

Ownership: the observer opens every sink it was given during ``inject_observer`` and closes each
exactly once during ``remove_observer``. A sink that wraps a caller-owned object (a logger, a
writer) flushes it on ``close`` but never closes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, TypeAlias, runtime_checkable

import pyarrow as pa

from ti_schema.cost import RunCost


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


Barrier: TypeAlias = Callable[[], None]
"""Returns once every signal the observer had queued when it was called is written."""


@dataclass(frozen=True)
class SinkCapabilities:
    """Optional behaviour a sink declares (see :class:`Sink`); the defaults are a plain sink.

    The observer reads a sink's declaration once, when it is attached, and never probes the
    sink for other attributes.
    """

    background_writes: bool = False
    """``write_history``/``write_histograms`` are thread-safe and may be called from the
    observer's emission worker thread. The observer reduces and writes there only when every
    sink of the run declares it; otherwise every write happens on the training thread."""
    on_barrier: Callable[[Barrier], None] | None = None
    """Called once at attach, when the observer writes from its worker, with a :data:`Barrier`.
    The sink calls the barrier before serving a read (a flush, an in-memory table) that must
    include every signal that ended before it."""
    flush: Callable[[], None] | None = None
    """Publish now, durably, every record received so far, and return once it is published;
    the sink stays open. The observer calls it when the process is about to end without
    ``close``: on SIGTERM (preemption) and at interpreter exit, from a thread of its own that it
    waits for a bounded time. The signal may stop the training thread anywhere, even inside one
    of this sink's writes, so the flush must not wait on a lock that a write holds for long. A
    sink with nothing a process exit could lose (in memory only, or unbuffered) leaves it
    None."""
    write_events: Callable[[pa.RecordBatch], None] | None = None
    """Accept one batch of ``ti.events`` rows (``ti_schema.events_schema()``), called on the
    thread that detected the event (the training thread, or the one that ran backward) as it
    happens. Events are rare and urgent: a file sink publishes them at once. A sink that leaves
    it None receives no events (the history rows of the dense capture still reach it)."""
    write_cost: Callable[[RunCost], None] | None = None
    """Accept the run's measured telemetry cost (:class:`~ti_schema.cost.RunCost`): the latest
    figure, which replaces any earlier one. Called on the training thread at removal (before
    ``close``), before each ``flush``, and at most once a minute at a sampled forward; it must
    return quickly. A sink that leaves it None is not told the cost."""

    def __post_init__(self) -> None:
        if not isinstance(self.background_writes, bool):
            raise TypeError(
                "SinkCapabilities(background_writes=...) must be True or False, "
                f"got {self.background_writes!r}"
            )
        if self.on_barrier is not None and not callable(self.on_barrier):
            raise TypeError(
                "SinkCapabilities(on_barrier=...) must be a callable taking the barrier "
                f"(e.g. a bound method of the sink) or None, got {self.on_barrier!r}"
            )
        if self.flush is not None and not callable(self.flush):
            raise TypeError(
                "SinkCapabilities(flush=...) must be a callable taking no arguments "
                f"(e.g. the sink's bound flush method) or None, got {self.flush!r}"
            )
        if self.write_events is not None and not callable(self.write_events):
            raise TypeError(
                "SinkCapabilities(write_events=...) must be a callable taking a ti.events "
                f"RecordBatch (e.g. the sink's bound method) or None, got {self.write_events!r}"
            )
        if self.write_cost is not None and not callable(self.write_cost):
            raise TypeError(
                "SinkCapabilities(write_cost=...) must be a callable taking a ti_schema.RunCost "
                f"(e.g. the sink's bound method) or None, got {self.write_cost!r}"
            )


@runtime_checkable
class Sink(Protocol):
    """Receives columnar records from the observer.

    ``write_history`` batches conform to ``ti_schema.history_schema()``; ``write_histograms``
    batches to ``ti_schema.histogram_schema()``. Both are called on the training thread (or the
    thread that ran backward) and must return quickly: slow work belongs on the sink's own worker.

    Optional capabilities are declared, not guessed: a sink that also defines
    ``capabilities(self) -> SinkCapabilities`` (the :class:`DeclaresCapabilities` protocol) may
    have its writes come from the observer's emission worker (``background_writes=True``),
    receive a barrier to wait for queued signals (``on_barrier``), be asked to publish what
    it holds when the process is about to end (``flush``), receive the run's ``ti.events``
    rows (``write_events``) and its measured telemetry cost (``write_cost``). A sink without the
    method gets ``SinkCapabilities()``: training-thread writes, no barrier, no flush.
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


@runtime_checkable
class DeclaresCapabilities(Protocol):
    """A sink that declares its :class:`SinkCapabilities` (an optional part of :class:`Sink`)."""

    def capabilities(self) -> SinkCapabilities:
        """What this sink supports beyond the :class:`Sink` protocol."""
        ...


def sink_capabilities(sink: object) -> SinkCapabilities:
    """The capabilities ``sink`` declares, or ``SinkCapabilities()`` when it declares none.

    Raises TypeError naming the sink when its ``capabilities`` is not a method returning a
    :class:`SinkCapabilities`.
    """
    if not isinstance(sink, DeclaresCapabilities):
        return SinkCapabilities()
    declare = sink.capabilities
    if not callable(declare):
        raise TypeError(
            f"{sink!r}.capabilities must be a method returning ti_schema.SinkCapabilities, "
            f"got {declare!r}"
        )
    declared = declare()
    if not isinstance(declared, SinkCapabilities):
        raise TypeError(
            f"{sink!r}.capabilities() must return a ti_schema.SinkCapabilities, got {declared!r}"
        )
    return declared
