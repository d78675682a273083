"""Where and when ended signals are written: inline, or on the observer's emission worker.

One interface (:class:`Emitter`), two implementations, in the spirit of OpenTelemetry's simple
(synchronous) and batch (background) span processors. The observer picks one at attach time
(docs/capture.md, "Where the reduction runs", says when the worker is used):

- :class:`InlineEmitter` writes each signal on the thread whose forward or backward ended it.
- :class:`BackgroundEmitter` queues signals of host tensors on one
  :class:`~ti_core.emission.worker.EmissionWorker`; a signal holding accelerator tensors, or one
  that ends after :meth:`Emitter.close`, is written inline once the queue has caught up, and a
  small one inline when the queue is empty, so sinks always receive signals in the order they
  ended (the choice is :func:`ti_core.reduction.placement.signal_thread`'s). Failures on the
  worker are deferred to the training thread (``ErrorPolicy.deferred``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from ti_core.emission.worker import EmissionWorker, WorkerActivity
from ti_core.emission.writer import SignalWriter
from ti_core.errors import ErrorPolicy
from ti_core.reduction.ended import EndedSignal
from ti_core.reduction.placement import SignalThread, signal_thread


class Emitter(Protocol):
    """Writes ended signals through a :class:`SignalWriter`, in the order they ended."""

    @property
    def thread(self) -> threading.Thread | None:
        """The thread writing signals now (None: inline, or the worker is idle/not started)."""
        ...

    def emit(self, ended: EndedSignal) -> None:
        """Write ``ended`` now or later; raises only what the error policy raises (inline)."""
        ...

    def drain(self) -> None:
        """Return once every signal emitted so far is written."""
        ...

    def barrier(self) -> Callable[[], None] | None:
        """What a sink calls before serving reads, or None when writes are never deferred."""
        ...

    def close(self) -> None:
        """Write everything still queued; later signals are written inline."""
        ...


class InlineEmitter:
    """Writes each signal at once, on the thread that ended it."""

    def __init__(self, writer: SignalWriter) -> None:
        self._writer = writer

    @property
    def thread(self) -> threading.Thread | None:
        return None

    def emit(self, ended: EndedSignal) -> None:
        self._writer.write(ended)

    def drain(self) -> None:
        return None

    def barrier(self) -> Callable[[], None] | None:
        return None

    def close(self) -> None:
        return None


class BackgroundEmitter:
    """Writes signals of host tensors on one background thread, first in, first out."""

    def __init__(
        self,
        writer: SignalWriter,
        errors: ErrorPolicy,
        *,
        name: str,
        max_bytes: int,
        activity: WorkerActivity | None = None,
    ) -> None:
        self._writer = writer
        self._errors = errors
        self._worker = EmissionWorker(name, max_bytes=max_bytes, activity=activity)

    @property
    def thread(self) -> threading.Thread | None:
        return self._worker.thread

    def emit(self, ended: EndedSignal) -> None:
        batch = ended.batch
        where = signal_thread(batch.pending_bytes, batch.host_only, worker_idle=self._worker.idle)
        if where is SignalThread.WORKER and self._worker.submit(
            lambda: self._write_deferring(ended), batch.pending_bytes
        ):
            return
        if where is not SignalThread.HERE:
            self._worker.drain()  # keep the sinks' order: earlier signals first
        self._writer.write(ended)

    def _write_deferring(self, ended: EndedSignal) -> None:
        # Runs on the worker: warnings wait for the training thread.
        with self._errors.deferred():
            try:
                self._writer.write(ended)
            except Exception as error:
                self._errors.handle(ended.stage, error)

    def drain(self) -> None:
        self._worker.drain()

    def barrier(self) -> Callable[[], None]:
        """Waits for the queued signals; holds this emitter weakly, so a sink kept after the
        run does not keep the observer's machinery alive."""
        ref = weakref.ref(self)

        def barrier() -> None:
            live = ref()
            if live is not None:
                live.drain()

        return barrier

    def close(self) -> None:
        self._worker.close()  # runs every queued signal first: nothing measured is lost


__all__ = ["BackgroundEmitter", "Emitter", "InlineEmitter"]
