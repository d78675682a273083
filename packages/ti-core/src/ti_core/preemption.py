"""Publishing what observers hold when the process is about to end: on SIGTERM and at exit.

Clusters preempt a job with SIGTERM (SLURM, Kubernetes) and send SIGKILL a grace period later;
a program may also exit without ``remove_observer``. Either way the rows and histograms of the
signals that had ended are still queued on an observer's emission worker or buffered in a sink.
Publishing them here means: every sink that declares ``SinkCapabilities(flush=...)`` is
flushed (ti-io's ``DirectorySink`` publishes its buffers as parts, which ``ti consolidate``
finishes), after the signals queued on the observer's emission worker are written: a sink that
took the barrier (``on_barrier``) waits for them in its flush, for the others the observer
waits first (``Observer.drain``).
ti-core never imports a sink's package: the flush goes through the declared capability.

SIGTERM (docs/reliability.md, "Preemption"): a handler is installed when the first observer
that handles SIGTERM (``inject_observer(..., handle_sigterm=True)``, the default) is attached
from the main thread, and only when the disposition it replaces is the default action or a
Python handler (an ignored signal, or a handler installed outside Python, is left alone). On
the signal it publishes on a helper thread, waiting at most :data:`SIGTERM_PUBLISH_TIMEOUT_S`
(the signal may have stopped the training thread inside a write whose lock the publication
needs), then runs the previous handler, unchanged, or, for the default action, restores it and
raises the signal again, so the process ends as SIGTERM would have ended it. The handler is
removed when the last such observer is removed, if it is still the one installed (a handler
installed after it, which may chain to it, is left in place). A forked child (a DataLoader
worker) that inherited it publishes only observers it attached itself: the others' threads
and sinks are its parent's.

Interpreter exit: an ``atexit`` hook, registered with the first observer, publishes every live
observer (``handle_sigterm`` or not) on the exiting thread; nothing interrupted it there.

Ownership: ``api.inject_observer`` calls :func:`watch` once the observer is attached, and
``api.remove_observer`` calls :func:`unwatch` once it is detached. Observers are held weakly.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Final, Protocol, TypeAlias

from ti_core.emission.sinks import SinkFanout


class Observer(Protocol):
    """What publication needs of an observer (:class:`ti_core.observer.Observer`): its sinks,
    a wait for its emission worker, and its cost report. A protocol, so that this module sits
    beside the observer rather than above it (the api, which owns both, pairs them)."""

    sinks: SinkFanout

    def drain(self) -> None: ...

    def report_cost(self, *, exiting: bool = False) -> None: ...


SIGTERM_PUBLISH_TIMEOUT_S: Final[float] = 10.0
"""How long the SIGTERM handler waits for the publication before passing the signal on.
Typical publication takes milliseconds (one part per sink); preemption grace periods are
usually 30 s (Kubernetes' terminationGracePeriodSeconds, SLURM's KillWait)."""

Handler: TypeAlias = Callable[[int, FrameType | None], object] | int | None
"""What ``signal.getsignal`` returns: a callable, ``SIG_DFL``/``SIG_IGN``, or None."""

_live: weakref.WeakKeyDictionary[Observer, tuple[bool, int]] = weakref.WeakKeyDictionary()
"""Every attached observer: whether it handles SIGTERM, and the process that attached it (a
forked child inherits its parent's observers, whose threads and sinks it must not use)."""
_installed: _SigtermHandler | None = None
_exit_hook = False


def _own(*, handling_sigterm: bool) -> list[Observer]:
    """This process's live observers (those handling SIGTERM, or all). Lock-free: the signal
    handler may run while the main thread is inside :func:`watch` or :func:`unwatch`."""
    pid = os.getpid()
    while True:
        try:
            entries = list(_live.items())
        except RuntimeError:  # changed size during the copy (another thread): copy again
            continue
        return [
            observer
            for observer, (handles, owner) in entries
            if owner == pid and (handles or not handling_sigterm)
        ]


class _SigtermHandler:
    """The installed SIGTERM handler: publish, then pass the signal on to ``previous``."""

    def __init__(self, previous: Handler) -> None:
        self.previous = previous

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        observers = _own(handling_sigterm=True)
        publish(observers, "SIGTERM", timeout=SIGTERM_PUBLISH_TIMEOUT_S)
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
            return
        # The default action: end the process as the signal would have (exit status -SIGTERM).
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def watch(observer: Observer, *, handle_sigterm: bool) -> None:
    """Publish ``observer`` at interpreter exit and, if ``handle_sigterm``, on SIGTERM."""
    global _exit_hook
    _live[observer] = (handle_sigterm, os.getpid())
    if not _exit_hook:
        # Registered with the first observer, after its sinks' packages were imported, so
        # this runs before their own exit hooks (atexit runs the last registered first).
        atexit.register(_publish_at_exit)
        _exit_hook = True
    if handle_sigterm:
        _install()


def unwatch(observer: Observer) -> None:
    """``observer`` was removed; drop the SIGTERM handler when no observer needs it."""
    _live.pop(observer, None)
    if not _own(handling_sigterm=True):
        _uninstall()


def installed_handler() -> Callable[[int, FrameType | None], None] | None:
    """The SIGTERM handler installed by ti-core and still in place, or None (diagnostics)."""
    handler = _installed
    return handler if handler is not None and signal.getsignal(signal.SIGTERM) is handler else None


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install() -> None:
    global _installed
    if installed_handler() is not None or not _on_main_thread():
        return  # installed already, or not allowed here (only the main thread may)
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous == signal.SIG_IGN:
        return  # set outside Python (cannot be chained to) or ignored: the program decides
    handler = _SigtermHandler(previous)
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main interpreter
        return
    _installed = handler


def _uninstall() -> None:
    global _installed
    handler = installed_handler()
    if handler is None:
        _installed = None  # replaced since (it may chain to ours, which stays harmless)
        return
    if not _on_main_thread():
        return  # only the main thread may restore it; with no observer left it only passes on
    assert isinstance(handler, _SigtermHandler)
    signal.signal(signal.SIGTERM, handler.previous)
    _installed = None


def publish(observers: list[Observer], reason: str, *, timeout: float | None) -> bool:
    """Write the queued signals of ``observers`` and flush their sinks; True when done.

    With a ``timeout`` the work runs on a helper thread and this returns after at most that
    many seconds (False, with a line on stderr, when it had not finished); without, it runs
    on this thread.
    """
    if not observers:
        return True
    if timeout is None:
        for observer in observers:
            _publish_one(observer, reason)
        return True
    done = threading.Event()

    def work() -> None:
        try:
            for observer in observers:
                _publish_one(observer, reason)
        finally:
            done.set()

    threading.Thread(target=work, name="ti-core publish", daemon=True).start()
    if done.wait(timeout):
        return True
    _say(
        f"ti-core: {reason}: publishing the buffered rows did not finish within {timeout:g} s; "
        "passing the signal on (rows not published by then are lost)"
    )
    return False


def _publish_one(observer: Observer, reason: str) -> None:
    declared = observer.sinks.capabilities
    if any(c.flush is not None and c.on_barrier is None for c in declared):
        # Such a sink cannot wait for the emission worker's queue itself (a sink that took
        # the barrier calls it in its flush, as DirectorySink does): wait for it here.
        try:
            observer.drain()
        except Exception as error:  # error_policy="raise" re-raises a worker's failure here
            _say(f"ti-core: {reason}: writing the queued signals failed: {error!r}")
    try:
        observer.report_cost(exiting=True)  # the latest figure, published with the flush
    except Exception as error:  # error_policy="raise": nobody is left to raise to
        _say(f"ti-core: {reason}: reporting the telemetry cost failed: {error!r}")
    for sink, failure in observer.sinks.flush():
        try:
            observer.sinks.report(sink, "flushing", failure)
        except Exception:  # error_policy="raise": nobody is left to raise to
            _say(f"ti-core: {reason}: flushing {type(sink).__name__} failed: {failure!r}")


def _publish_at_exit() -> None:
    publish(_own(handling_sigterm=False), "interpreter exit", timeout=None)


def _say(line: str) -> None:
    with contextlib.suppress(Exception):  # stderr closed at shutdown: nothing left to tell
        print(line, file=sys.stderr, flush=True)


__all__ = [
    "SIGTERM_PUBLISH_TIMEOUT_S",
    "installed_handler",
    "publish",
    "unwatch",
    "watch",
]
