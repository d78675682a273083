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

from ti_core.capture.batch import TensorBatch, tensor_version
from ti_core.capture.context import now_us
from ti_core.capture.hooks import HookObject
from ti_core.errors import ErrorPolicy
from ti_core.records import Entry
from ti_core.reduction.support import dtype_name


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
    unchanged tensor output by several calls gets one hook serving all of their entries.
    """

    __slots__ = (
        "batch",
        "entries",
        "forward_index",
        "hooked",
        "lock",
        "queued",
        "recorded",
        "sample_id",
        "target_ref",
    )

    def __init__(
        self, target_ref: weakref.ref[GradientTarget], sample_id: int, forward_index: int
    ) -> None:
        self.target_ref = target_ref
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.entries: list[Entry] = []
        self.recorded: set[int] = set()
        self.batch: TensorBatch | None = None
        self.queued = False
        self.lock = threading.Lock()
        self.hooked: dict[int, tuple[weakref.ref[torch.Tensor], int | None, GradHook]] = {}

    def watch(self, entry: Entry, tensor: torch.Tensor) -> None:
        """Register the gradient hook of ``tensor`` (a non-leaf that requires grad)."""
        index = len(self.entries)
        self.entries.append(entry)
        version = tensor_version(tensor)
        seen = self.hooked.get(id(tensor))
        if seen is not None and seen[1] == version and seen[0]() is tensor:
            seen[2].indices.append(index)
            return
        hook = GradHook(self, index)
        tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        self.hooked[id(tensor)] = (weakref.ref(tensor), version, hook)

    def forward_done(self) -> None:
        """The sampled forward returned: no more hooks will be registered."""
        self.hooked = {}

    def receive(self, indices: list[int], grad: torch.Tensor) -> None:
        target = self.target_ref()
        if target is None or target.closed:
            return
        try:
            with self.lock:
                stamp = now_us()
                shape = tuple(grad.shape)
                dtype = dtype_name(grad.dtype)
                for index in indices:
                    if index in self.recorded:
                        continue
                    self.recorded.add(index)
                    fwd = self.entries[index]
                    entry = Entry(
                        fwd.layer,
                        fwd.call_index,
                        fwd.path,
                        fwd.train,
                        fwd.grad_enabled,
                        shape,
                        dtype,
                        stamp,
                    )
                    if self.batch is None:
                        self.batch = target.new_batch()
                    self.batch.add(entry, grad)
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

    __slots__ = ("indices", "state")

    def __init__(self, state: GradientState, index: int) -> None:
        self.state = state
        self.indices = [index]

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.state.receive(self.indices, grad)


__all__ = ["GradHook", "GradientState", "GradientTarget"]
