"""Replay mode's checks at the root: the hooks that keep the gradient flowing into the root's
output and check the parameters' gradients when the backward ends.

Ownership: :meth:`FlightRecorder.end_root <ti_core.sentinel.recorder.FlightRecorder.end_root>`
hooks a :class:`RootGradient` on the backward node of each root output tensor of a forward
with gradients (living as long as the autograd graph). The first one a backward reaches keeps
the gradient into the root's output in the forward's :class:`~ti_core.sentinel.replay.StepRecord`
and queues one :class:`BackwardEnd` on the autograd engine; that one queues itself again, so
it runs after the callbacks queued during the backward (``DistributedDataParallel``'s, which
write the reduced gradients into ``.grad``), then hands the forward to
:meth:`FlightRecorder.backward_ended <ti_core.sentinel.recorder.FlightRecorder.backward_ended>`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor

from ti_core import _torch
from ti_core.sentinel.replay import StepRecord


class RootForward(Protocol):
    """What these hooks read and set of one root forward (the recorder's ``_Forward``)."""

    watch: Any
    step: StepRecord | None
    ending: bool


class BackwardTarget(Protocol):
    """Who is told that a backward through a root forward's output ended (the recorder)."""

    @property
    def closed(self) -> bool: ...

    def backward_ended(self, forward: Any) -> None: ...


class RootGradient:
    """Pre-hook of the backward node that made one of the root's output tensors (output
    ``output_nr`` of it, position ``position`` among the root's output tensors): keeps the
    gradient flowing into it for a replay and starts the backward-end check; never changes
    the gradient."""

    __slots__ = ("__weakref__", "forward", "output_nr", "position", "recorder")

    def __init__(
        self,
        recorder: Callable[[], BackwardTarget | None],
        forward: RootForward,
        position: int,
        output_nr: int,
    ) -> None:
        self.recorder = recorder
        self.forward = forward
        self.position = position
        self.output_nr = output_nr

    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        forward = self.forward
        watch = forward.watch
        if watch is not None:
            watch.ran = True
        grad = grad_outputs[self.output_nr]
        step = forward.step
        if grad is not None and step is not None:
            step.output_grads[self.position] = grad
        if not forward.ending:
            forward.ending = True
            _torch.queue_callback(BackwardEnd(self.recorder, forward).first)


class BackwardEnd:
    """The end of one backward through a root forward's output (an engine callback)."""

    __slots__ = ("forward", "recorder")

    def __init__(self, recorder: Callable[[], BackwardTarget | None], forward: RootForward) -> None:
        self.recorder = recorder
        self.forward = forward

    def first(self) -> None:
        """Queued when the backward reached the root's output: queue the check behind the
        callbacks queued since (the reductions across ranks that fill ``.grad``)."""
        _torch.queue_callback(self.last)

    def last(self) -> None:
        forward = self.forward
        forward.ending = False
        recorder = self.recorder()
        if recorder is None or recorder.closed:
            return
        recorder.backward_ended(forward)


__all__ = ["BackwardEnd", "BackwardTarget", "RootForward", "RootGradient"]
