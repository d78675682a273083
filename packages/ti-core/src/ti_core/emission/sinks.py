"""The sinks of one observer: what each can do, and the one fan-out every record goes through.

Ownership: the observer opens its sinks in ``inject_observer`` (before this exists) and closes
each exactly once through :meth:`SinkFanout.close` in ``remove_observer``. Every write of every
signal, inline or from the emission worker, goes through :meth:`SinkFanout.write_history` /
:meth:`SinkFanout.write_histograms` (events: :meth:`SinkFanout.write_events`), under one lock,
so sinks see one writer at a time and nothing after their close. :meth:`SinkFanout.flush`
(SIGTERM, interpreter exit) calls the sinks' declared ``flush`` outside that lock.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Literal

import pyarrow as pa

from ti_core.errors import SINK_CONSEQUENCE, ErrorPolicy
from ti_core.sink import Barrier, Sink, SinkCapabilities, sink_capabilities
from ti_schema.cost import RunCost

SinkAction = Literal["writing to", "flushing", "closing"]
"""What was being done to a sink when it failed (the start of the warning's stage)."""


def read_capabilities(sinks: Sequence[Sink]) -> tuple[SinkCapabilities, ...]:
    """What each sink declares beyond the ``Sink`` protocol, in order: read once per run, at
    injection, through ti-schema's :func:`~ti_schema.sink_capabilities` (a sink without a
    ``capabilities()`` method gets the defaults; a malformed declaration raises TypeError
    naming the sink). Nothing else in ti-core asks a sink what it supports."""
    return tuple(sink_capabilities(sink) for sink in sinks)


class SinkFanout:
    """Hands each record batch to every sink, in order; one sink's failure spares the others."""

    def __init__(
        self, sinks: Sequence[Sink], capabilities: Sequence[SinkCapabilities], errors: ErrorPolicy
    ) -> None:
        if len(capabilities) != len(sinks):
            raise ValueError("SinkFanout needs one SinkCapabilities per sink")
        self.sinks = tuple(sinks)
        self.capabilities = tuple(capabilities)
        """Each sink's declaration (:func:`read_capabilities`), in the order of ``sinks``."""
        self.want_cost = any(declared.write_cost is not None for declared in self.capabilities)
        """Whether any sink declared ``write_cost``."""
        self._errors = errors
        self._lock = threading.Lock()
        self._closed = False
        _fanouts.add(self)

    def offer_barrier(self, barrier: Barrier) -> None:
        """Hand ``barrier`` to every sink that declared ``on_barrier`` (once, at attach)."""
        for declared in self.capabilities:
            if declared.on_barrier is not None:
                declared.on_barrier(barrier)

    def write_history(self, batch: pa.RecordBatch) -> None:
        """Give one ``ti.history`` batch to every sink (dropped once the sinks are closed)."""
        with self._lock:
            if self._closed:
                return
            for sink in self.sinks:
                try:
                    sink.write_history(batch)
                except Exception as error:
                    self.report(sink, "writing to", error)

    def write_histograms(self, batch: pa.RecordBatch) -> None:
        """Give one ``ti.histograms`` batch to every sink (dropped once the sinks are closed)."""
        with self._lock:
            if self._closed:
                return
            for sink in self.sinks:
                try:
                    sink.write_histograms(batch)
                except Exception as error:
                    self.report(sink, "writing to", error)

    def write_events(self, batch: pa.RecordBatch) -> None:
        """Give one ``ti.events`` batch to every sink that declared ``write_events`` (dropped
        once the sinks are closed)."""
        with self._lock:
            if self._closed:
                return
            for sink, declared in zip(self.sinks, self.capabilities, strict=True):
                if declared.write_events is None:
                    continue
                try:
                    declared.write_events(batch)
                except Exception as error:
                    self.report(sink, "writing to", error)

    def write_cost(self, cost: RunCost, *, exiting: bool = False) -> None:
        """Give the run's latest telemetry cost to every sink that declared ``write_cost``
        (dropped once the sinks are closed). ``exiting``: for the end of a process, without the
        lock, as :meth:`flush`."""
        if exiting:
            self._write_cost(cost)
            return
        with self._lock:
            self._write_cost(cost)

    def _write_cost(self, cost: RunCost) -> None:
        if self._closed:
            return
        for sink, declared in zip(self.sinks, self.capabilities, strict=True):
            if declared.write_cost is None:
                continue
            try:
                declared.write_cost(cost)
            except Exception as error:
                self.report(sink, "writing to", error)

    def flush(self) -> list[tuple[Sink, Exception]]:
        """Ask each sink that declared ``flush`` to publish what it holds, in order; return the
        failures. For the end of a process (``ti_core.preemption``), so without the lock: the
        signal may have stopped the training thread inside a write that holds it. Nothing once
        the sinks are closed."""
        failures: list[tuple[Sink, Exception]] = []
        for sink, declared in zip(self.sinks, self.capabilities, strict=True):
            if self._closed:
                break
            if declared.flush is None:
                continue
            try:
                declared.flush()
            except Exception as error:
                failures.append((sink, error))
        return failures

    def close(self) -> list[tuple[Sink, Exception]]:
        """Close every sink once, after any write in progress; return the close failures (the
        caller reports them once the model is clean: under ``raise`` they propagate)."""
        failures: list[tuple[Sink, Exception]] = []
        with self._lock:
            self._closed = True
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception as error:
                    failures.append((sink, error))
        return failures

    def report(self, sink: Sink, action: SinkAction, error: BaseException) -> None:
        """One sink's write or close failed: under ``warn``, one warning per sink and error
        type for the whole run (a broken directory fails every later write and the close)."""
        self._errors.handle(
            f"{action} {type(sink).__name__}",
            error,
            key=("sink", id(sink)),
            consequence=SINK_CONSEQUENCE,
        )

    def _reset_in_child(self) -> None:
        # The emission worker may have held the lock at the fork; no other thread exists in the
        # child, so a fresh lock is safe (a thread inside ``with`` releases the lock it took).
        self._lock = threading.Lock()


_fanouts: weakref.WeakSet[SinkFanout] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for fanout in list(_fanouts):
        fanout._reset_in_child()


if hasattr(os, "register_at_fork"):  # POSIX; spawned processes start clean anyway
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["SinkAction", "SinkFanout", "read_capabilities"]
