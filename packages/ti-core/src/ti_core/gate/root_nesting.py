"""Root forwards per thread: how deep this thread is in root calls, the frame of the outermost
one, and its sample (a root module may call itself, or a wrapper may call the root).

Each thread's forwards are sampled and recorded independently: the gate keeps one
:class:`ThreadRoots` (a ``threading.local``) and reads it in every root hook.
"""

from __future__ import annotations

import threading
from types import FrameType

from ti_core.capture.sample import Sample


class ThreadRoots(threading.local):
    """This thread's root forwards (each thread sees its own values)."""

    depth = 0
    """Nesting depth of root calls on this thread (0 outside any)."""
    outer: FrameType | None = None
    """The frame that ran the outermost root call's hooks: tells a nested root call from state
    left behind by one that a BaseException (KeyboardInterrupt) interrupted."""
    sample: Sample | None = None
    """The sample of the outermost root forward, when it is sampled."""
    paused = False
    """The root's and the modules' hooks do nothing on this thread: the flight recorder
    replays a step (:meth:`ti_core.gate.Gate.replaying`), or the forward runs outside the
    scopes a scoped observer records (:meth:`ti_core.gate.Gate.within`)."""

    def inside(self, caller: FrameType) -> bool:
        """Whether ``caller`` runs inside this thread's outermost root forward."""
        return bool(self.depth) and has_ancestor(caller, self.outer)

    def reset(self) -> Sample | None:
        """Drop the state of an interrupted root forward; return its sample, if any."""
        sample = self.sample
        self.depth = 0
        self.outer = None
        self.sample = None
        return sample


class ScopedRoots(ThreadRoots):
    """Root forwards of an observer that records only inside scopes (a pipeline stage's
    microbatches, :meth:`ti_core.gate.Gate.within`): every thread starts paused."""

    paused = True


def has_ancestor(frame: FrameType, target: FrameType | None) -> bool:
    """Whether ``target`` is ``frame`` or one of its callers."""
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


__all__ = ["ScopedRoots", "ThreadRoots", "has_ancestor"]
