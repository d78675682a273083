"""The sinks of one observer: what each can do, and the one fan-out every record goes through.

Ownership: the observer opens its sinks in ``inject_observer`` (before this exists) and closes
each exactly once through :meth:`SinkFanout.close` in ``remove_observer``. Every write of every
signal, inline or from the emission worker, goes through :meth:`SinkFanout.write_history` /
:meth:`SinkFanout.write_histograms`, under one lock, so sinks see one writer at a time and
nothing after their close.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import pyarrow as pa

from ti_core.errors import SINK_CONSEQUENCE, ErrorPolicy
from ti_core.sink import Sink

SinkAction = Literal["writing to", "closing"]
"""What was being done to a sink when it failed (the start of the warning's stage)."""


class SinkCapabilities(NamedTuple):
    """The optional parts of the ``Sink`` protocol one sink declares."""

    background_writes: bool
    """Its writes may come from the observer's emission worker (they are thread-safe)."""
    attach_barrier: Callable[[Callable[[], None]], None] | None
    """Receives a callable that waits for the observer's queued signals (before reads)."""


def sink_capabilities(sink: Sink) -> SinkCapabilities:
    """What ``sink`` declares beyond the ``Sink`` protocol (the one place that asks)."""
    return SinkCapabilities(
        background_writes=bool(getattr(sink, "accepts_background_writes", False)),
        attach_barrier=getattr(sink, "attach_barrier", None),
    )


class SinkFanout:
    """Hands each record batch to every sink, in order; one sink's failure spares the others."""

    def __init__(self, sinks: Sequence[Sink], errors: ErrorPolicy) -> None:
        self.sinks = tuple(sinks)
        self._errors = errors
        self._lock = threading.Lock()
        self._closed = False
        _fanouts.add(self)

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


__all__ = ["SinkAction", "SinkCapabilities", "SinkFanout", "sink_capabilities"]
