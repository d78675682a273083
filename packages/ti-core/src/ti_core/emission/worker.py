"""The emission worker: one background thread running an observer's emission jobs in order.

Why (docs/capture.md, "Where the reduction runs"): the training thread keeps the capture (hooks,
snapshots taken at the module boundary); this thread runs the reduction, the histograms, the
Arrow batches and the sink writes of each ended signal. On a 2-core machine the reduction's
numpy work (which releases the GIL) then overlaps the model's own compute instead of adding to
it. Used through :class:`ti_core.emission.emitters.BackgroundEmitter`.

Ownership and lifecycle: one worker per background emitter (so per observer); its thread
starts with a job and ends at :meth:`EmissionWorker.close` (``remove_observer``), after running
every job already submitted, or after ``IDLE_EXIT_S`` without work (the next job starts a new
one), so an observer dropped without removal leaves no thread behind. One thread runs the jobs
in submission order, so rows reach the sinks in the order their signals ended. Backpressure:
:meth:`submit` blocks while the queued jobs hold more snapshot bytes than the budget or more
than ``max_jobs`` jobs are queued, so memory stays bounded when sampling outpaces the reduction.
A forked child starts with an empty queue and no thread (jobs queued before the fork are the
parent's).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Final, Protocol

MAX_JOBS: Final[int] = 8
"""Signals queued at most; a sampled step adds two (outputs, then gradients)."""
IDLE_EXIT_S: Final[float] = 5.0
"""The thread ends after this long without a job."""


class WorkerActivity(Protocol):
    """Told when the worker gets work and when it runs out (the run's
    :class:`~ti_core.cost.CostMeter`: the training-thread steps it overlaps are telemetry)."""

    def worker_busy(self) -> None: ...

    def worker_idle(self) -> None: ...


class EmissionWorker:
    """One background thread running the observer's emission jobs, first in, first out."""

    def __init__(
        self,
        name: str,
        max_bytes: int,
        max_jobs: int = MAX_JOBS,
        activity: WorkerActivity | None = None,
    ) -> None:
        self._name = name
        self._activity = activity
        self._max_bytes = max_bytes
        self._max_jobs = max_jobs
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], None], int]] = deque()
        self._bytes = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        _live.add(self)

    def _reset_in_child(self) -> None:
        # A forked child has no worker thread, and the lock may have been held at the fork;
        # jobs queued before the fork belong to the parent, which runs them.
        self._cond = threading.Condition()
        self._jobs = deque()
        self._bytes = 0
        self._thread = None

    @property
    def thread(self) -> threading.Thread | None:
        """The worker's thread once started (jobs run there)."""
        return self._thread

    @property
    def idle(self) -> bool:
        """No job queued or running (a job stays queued until it has run)."""
        return not self._jobs

    def submit(self, job: Callable[[], None], nbytes: int) -> bool:
        """Queue ``job`` (holding ``nbytes`` of snapshots); False once closed (run it inline).

        Blocks while the queue is full (backpressure). A job must handle its own errors.
        """
        with self._cond:
            if self._closed:
                return False
            while self._jobs and (
                len(self._jobs) >= self._max_jobs or self._bytes + nbytes > self._max_bytes
            ):
                self._cond.wait()
                if self._closed:
                    return False
            self._jobs.append((job, nbytes))
            self._bytes += nbytes
            if self._activity is not None:
                self._activity.worker_busy()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs and not self._closed:
                    self._cond.wait_for(lambda: self._jobs or self._closed, IDLE_EXIT_S)
                if not self._jobs:
                    if not self._closed:
                        self._thread = None  # idle: the next submit starts a fresh thread
                    return
                job, nbytes = self._jobs[0]  # stays queued (and counted) until it has run
            try:
                job()
            except BaseException:  # jobs report their own errors; keep the worker alive
                pass
            finally:
                del job  # what a job holds (snapshots) goes as soon as it has run
                with self._cond:
                    self._jobs.popleft()
                    self._bytes -= nbytes
                    if not self._jobs and self._activity is not None:
                        self._activity.worker_idle()
                    self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every job submitted so far has run (no-op on the worker's own thread)."""
        if threading.current_thread() is self._thread:
            return
        with self._cond:
            while self._jobs:
                self._cond.wait()

    def close(self) -> None:
        """Run every queued job, then stop the thread; later submits return False."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


_live: weakref.WeakSet[EmissionWorker] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for worker in list(_live):
        worker._reset_in_child()


if hasattr(os, "register_at_fork"):  # POSIX; spawned processes start clean anyway
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["MAX_JOBS", "EmissionWorker", "WorkerActivity"]
