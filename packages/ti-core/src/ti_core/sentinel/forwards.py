"""One root forward's checks, for the flight recorder (:mod:`~ti_core.sentinel.recorder`).

:class:`Forward` holds a root forward's output flags and its backward's gradient flags.
Gradient checks are pre-hooks of the backward nodes that produced the checked outputs
(:class:`GradientCheck`), living as long as the autograd graph (:class:`Watch` tells when it
is gone unused); each backward's flags are read when it ends (:class:`GradientFlush`, an
engine callback). A run with compiled graphs checks into slots instead (:func:`slot_check`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Final, Protocol

import torch
from torch import Tensor

from ti_core import _torch
from ti_core.compiled.slots import FlagSlots
from ti_core.errors import ErrorPolicy
from ti_core.sentinel.flags import Flags, real_values
from ti_core.sentinel.replay import StepRecord
from ti_core.sentinel.root_checks import RootGradient

SENTINEL_STAGE: Final = "sentinel check"


class Recorder(Protocol):
    """What these checks need of the flight recorder that owns them."""

    _errors: ErrorPolicy

    @property
    def closed(self) -> bool: ...

    @property
    def gradient_slots(self) -> FlagSlots: ...

    def gradients_checked(self, index: int, flags: Flags) -> None: ...


TRACED_ROOT: Final = (
    "the root's hooks ran inside the compiled graph: the forward's arguments were not kept "
    "(the event names the module its checks in the graph flagged)"
)


class Forward:
    """One root forward's output flags (per thread) and its backward's gradient flags."""

    __slots__ = (
        "_outputs",
        "calls",
        "device",
        "ending",
        "gradient_calls",
        "gradients",
        "index",
        "step",
        "unkept",
        "watch",
        "watched",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.step: StepRecord | None = None
        """Replay mode: what re-running it needs (None: not kept)."""
        self.unkept = TRACED_ROOT
        """Replay mode: why ``step`` is None."""
        self.ending = False
        """Replay mode: a backward through its output queued its backward-end check."""
        self.device: torch.device | str = "cpu"
        """Replay mode: where the check that fired read its tensors."""
        self._outputs: Flags | None = None
        self.gradients: GradientFlush | None = None
        self.watched = False  # a gradient check was hooked on one of its outputs
        self.watch: Watch | None = None
        """Its eager gradient checks' liveness (made with the first)."""
        self.calls: dict[tuple[int, str], int] = {}
        """Its eager calls per checked tensor, once the run has slots (each has its own)."""
        self.gradient_calls: dict[tuple[int, str], int] = {}
        """Its eager gradient checks per tensor, once the run has gradient slots."""

    @property
    def outputs(self) -> Flags:
        """Its output flags (dense mode; made at the first check)."""
        flags = self._outputs
        if flags is None:
            flags = self._outputs = Flags()
        return flags


class Watch:
    """The eager gradient checks hooked in one root forward: whether a backward ran any, and
    whether the autograd graph holding them still lives (kept while the forward waits for
    its gradient check, so nothing heavier than this is)."""

    __slots__ = ("probes", "ran")

    def __init__(self) -> None:
        self.probes: list[weakref.ref[GradientCheck] | weakref.ref[RootGradient]] = []
        self.ran = False

    def abandoned(self) -> bool:
        """Whether the graph is gone with no backward through it (inference with gradients
        enabled): the forward's gradient check will never come."""
        return not self.ran and all(probe() is None for probe in self.probes)


class GradientFlush:
    """The gradient flags one backward delivers to one root forward, read when it ends."""

    __slots__ = ("flags", "forward", "queued", "recorder")

    def __init__(self, recorder: Callable[[], Recorder | None], forward: Forward) -> None:
        self.recorder = recorder
        self.forward = forward
        self.flags = Flags()
        self.queued = False

    def _queue(self) -> None:
        if not self.queued:
            self.queued = True
            _torch.queue_callback(self.flush)

    def flush(self) -> None:
        recorder = self.recorder()
        flags, self.flags = self.flags, Flags()
        self.queued = False
        if self.forward.gradients is self:
            self.forward.gradients = None
        if recorder is None or recorder.closed:
            return
        try:
            recorder.gradients_checked(self.forward.index, flags)
        except Exception as error:
            recorder._errors.handle(SENTINEL_STAGE, error)


class GradientCheck:
    """Pre-hook of the backward node that produced a checked output: checks the gradient
    flowing into that output (the node's output ``output_nr``); never changes it."""

    __slots__ = ("__weakref__", "forward", "layer", "output_nr", "path", "recorder")

    def __init__(
        self,
        recorder: Callable[[], Recorder | None],
        forward: Forward,
        layer: int,
        path: str,
        output_nr: int,
    ) -> None:
        self.recorder = recorder
        self.forward = forward
        self.layer = layer
        self.path = path
        self.output_nr = output_nr

    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        watch = self.forward.watch
        if watch is not None:  # (made before this check was hooked)
            watch.ran = True
        recorder = self.recorder()
        if recorder is None or recorder.closed:
            return
        grad = grad_outputs[self.output_nr]
        if grad is None:
            return
        try:
            forward = self.forward
            slots = recorder.gradient_slots
            if slots.active and slot_check(
                slots, forward.gradient_calls, self.layer, self.path, grad
            ):
                return
            flush = forward.gradients
            if flush is None:
                flush = forward.gradients = GradientFlush(self.recorder, forward)
            flush.flags.add(self.layer, self.path, grad)
            if not flush.queued:
                flush._queue()
        except Exception as error:
            recorder._errors.handle(SENTINEL_STAGE, error)


def slot_check(
    slots: FlagSlots, calls: dict[tuple[int, str], int], layer: int, path: str, tensor: Tensor
) -> bool:
    """A compiled run's eager check (an output, or a gradient) into a slot of its own, so its
    order against the compiled graphs' checks is exact (``calls``: the root forward's count
    of such checks per tensor); False when it gets none (then it is checked as usual)."""
    values = real_values(tensor)
    if values is None:
        return True  # nothing to check
    slot = slots.eager_slot(calls, layer, path, values.device)
    if slot < 0:
        return False
    slots.flag(slot, values)
    return True


__all__ = [
    "SENTINEL_STAGE",
    "TRACED_ROOT",
    "Forward",
    "GradientCheck",
    "GradientFlush",
    "Watch",
    "slot_check",
]
