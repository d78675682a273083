"""Output gradients bound to the sample and call that produced their output (docs/capture.md).

Ownership: a :class:`GradientState` belongs to one sample and is held only by the autograd graph
(through the :class:`GradHook` tensor hooks of the sample's outputs) and, until the root forward
returns, by the sample. It holds its :class:`GradientTarget` weakly, so a forward whose backward
never comes leaks nothing once its graph is freed, and a graph kept after removal does not keep
the observer alive.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

import torch

from ti_core.capture.batch import Row, TensorBatch
from ti_core.capture.context import now_us
from ti_core.capture.hooks import HookObject
from ti_core.errors import ErrorPolicy


class GradientTarget(Protocol):
    """What a sample's gradients report to (the observer)."""

    @property
    def closed(self) -> bool:
        """True once the observer was removed: later gradients are dropped."""
        ...

    @property
    def errors(self) -> ErrorPolicy: ...

    def new_batch(self) -> TensorBatch:
        """An empty batch for one backward's gradients of one sample."""
        ...

    def finish_gradients(self, state: GradientState, batch: TensorBatch) -> None:
        """A backward that delivered ``batch`` to ``state``'s sample ended: emit it."""
        ...


class GradientState:
    """Gradient side of one sample: shared by its gradient hooks, owned by the autograd graph.

    Each output tensor's gradient is recorded the first time a backward reaches it; the rows of
    one backward are emitted when that backward ends (an autograd engine callback). The same
    unchanged tensor output by several calls (one forward slot) gets one hook serving all of
    their entries: a gradient row is the forward entry's identity with the gradient's shape,
    dtype and time, resolved when the batch is finished (no object per entry here).
    """

    __slots__ = (
        "batch",
        "entries",
        "forward_index",
        "hooked",
        "lock",
        "queued",
        "sample_id",
        "target_ref",
    )

    def __init__(
        self,
        target_ref: weakref.ref[GradientTarget],
        sample_id: int,
        forward_index: int,
        entries: list[Row],
    ) -> None:
        self.target_ref = target_ref
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.entries = entries
        """The sample's forward rows (read only here; the gradient rows take their identity)."""
        self.batch: TensorBatch | None = None
        self.queued = False
        self.lock = threading.Lock()
        self.hooked: dict[int, GradHook] = {}

    def watch(self, row: int, slot: int, tensor: torch.Tensor) -> None:
        """Forward entry ``row`` measured ``tensor`` (a non-leaf that requires grad) as forward
        slot ``slot``: hook its gradient, once per slot."""
        hook = self.hooked.get(slot)
        if hook is not None:
            hook.rows.append(row)
            return
        hook = GradHook(self, row)
        tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        self.hooked[slot] = hook

    def forward_done(self) -> None:
        """The sampled forward returned: no more hooks will be registered."""
        self.hooked = {}

    def receive(self, hook: GradHook, grad: torch.Tensor) -> None:
        target = self.target_ref()
        if target is None or target.closed:
            return
        try:
            with self.lock:
                rows = hook.rows
                done = hook.recorded
                if done == len(rows):  # a later backward through the same graph
                    return
                hook.recorded = len(rows)
                if self.batch is None:
                    self.batch = target.new_batch()
                self.batch.add_derived(grad, self.entries, rows[done:] if done else rows, now_us())
                if not self.queued:
                    torch.autograd.Variable._execution_engine.queue_callback(self.flush)
                    self.queued = True
        except Exception as error:
            target.errors.handle("gradient capture", error)

    def flush(self) -> None:
        """End of a backward: emit the gradients it delivered to this sample."""
        with self.lock:
            batch, self.batch, self.queued = self.batch, None, False
        target = self.target_ref()
        if target is None or target.closed or batch is None:
            return
        target.finish_gradients(self, batch)


class GradHook(HookObject):
    """Tensor hook bound to (sample, call, tensor_path) entries; never changes the gradient."""

    __slots__ = ("recorded", "rows", "state")

    def __init__(self, state: GradientState, row: int) -> None:
        self.state = state
        self.rows = [row]
        """The forward entries (indices into the sample's forward rows) this gradient answers."""
        self.recorded = 0
        """How many of ``rows`` got their gradient (the first backward reaching them)."""

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.state.receive(self, grad)


__all__ = ["GradHook", "GradientState", "GradientTarget"]
