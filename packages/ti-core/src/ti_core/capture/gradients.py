"""Output gradients bound to the sample and call that produced their output (docs/capture.md).

Ownership: a :class:`GradientState` belongs to one sample and is held only by the autograd graph
(through the :class:`GradHook` tensor hooks of the sample's outputs) and, until the root forward
returns, by the sample. It holds its :class:`GradientTarget` weakly, so a forward whose backward
never comes leaks nothing once its graph is freed, and a graph kept after removal does not keep
the observer alive.

A leaf output (an input that requires grad, or a parameter, returned unchanged) has no graph of
its own to die with: its hook lives on the tensor. The observer's :class:`LeafHooks` keeps each
one's handle and removes it after the first backward that reaches it, when a later sampled
forward returns the same leaf, or at removal. Its gradient is that forward's output gradient
only when no other root forward ran before the backward (a parameter sums the gradients of
every forward that used it): otherwise the row is unavailable, with the reason.
"""

from __future__ import annotations

import threading
import weakref
from typing import Final, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ti_core import _torch
from ti_core.call_context import now_us
from ti_core.capture.hooks import HookObject
from ti_core.entries import Entry, Gaps
from ti_core.reduction.batch import Row, TensorBatch
from ti_core.reduction.ended import EndedSignal, SignalTarget
from ti_core.reduction.support import dtype_name
from ti_core.stages import stage_of

LEAF_SHARED_REASON: Final[str] = (
    "gradient not captured: the output is a leaf tensor (an input or parameter returned "
    "unchanged) that another root forward used before this backward, so its gradient is not "
    "this forward's alone"
)


class GradientTarget(SignalTarget, Protocol):
    """What a sample's gradients report to (the observer): a :class:`SignalTarget` that also
    keeps the hooks on leaf outputs and knows the latest root forward."""

    @property
    def leaf_hooks(self) -> LeafHooks:
        """The hooks on leaf outputs (which outlive the sample's graph)."""
        ...

    def forward_started_since(self, forward_index: int) -> bool:
        """Whether a root forward after ``forward_index`` has started (on any thread)."""
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
        "gaps",
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
        self.gaps: Gaps | None = None
        """Entries of this backward whose gradient is not theirs alone (leaves), with why."""
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

    def watch_leaf(self, row: int, slot: int, tensor: torch.Tensor) -> None:
        """Forward entry ``row`` measured ``tensor``, a leaf that requires grad: hook its
        gradient once per slot, the handle kept by the target's :class:`LeafHooks`."""
        hook = self.hooked.get(slot)
        if hook is not None:
            hook.rows.append(row)
            return
        target = self.target_ref()
        if target is None:
            return
        hook = GradHook(self, row, leaf=True)
        handle = tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        self.hooked[slot] = hook
        target.leaf_hooks.add(tensor, hook, handle)

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
                fresh = rows[done:] if done else rows
                if hook.leaf:
                    target.leaf_hooks.discard(hook)  # its one backward: the hook goes
                if hook.leaf and (hook.shared or target.forward_started_since(self.forward_index)):
                    self._add_gaps(fresh, grad, LEAF_SHARED_REASON)
                else:
                    if self.batch is None:
                        self.batch = target.new_batch()
                    self.batch.add_derived(grad, self.entries, fresh, now_us())
                if not self.queued:
                    _torch.queue_callback(self.flush)
                    self.queued = True
        except Exception as error:
            target.errors.handle(stage_of("output_gradient", "capture"), error)

    def _add_gaps(self, rows: list[int], tensor: torch.Tensor, reason: str) -> None:
        """Forward entries ``rows`` (which measured ``tensor``) get an unavailable gradient row
        for ``reason`` (call under ``lock``)."""
        if self.gaps is None:
            self.gaps = Gaps()
        shape, dtype, stamp = tuple(tensor.shape), dtype_name(tensor.dtype), now_us()
        for row in rows:
            layer, call_index, path, train, grad_enabled, _ = self.entries[row]
            self.gaps.add(
                Entry(layer, call_index, path, train, grad_enabled, shape, dtype, stamp), reason
            )

    def flush(self) -> None:
        """End of a backward: emit the gradients it delivered to this sample, and the entries
        whose gradient came but is not theirs alone (with the reasons)."""
        with self.lock:
            batch, self.batch, self.queued = self.batch, None, False
            gaps, self.gaps = self.gaps, None
        target = self.target_ref()
        if target is None or target.closed or (batch is None and gaps is None):
            return
        if batch is None:
            batch = target.new_batch()
        target.emit(EndedSignal("output_gradient", self.sample_id, self.forward_index, batch, gaps))

    def unanswered(self, hook: GradHook, leaf: torch.Tensor) -> None:
        """``hook``'s ``leaf`` was returned again by a later sampled forward before a backward
        reached it: its entries get the reason instead of a gradient, emitted now."""
        with self.lock:
            if hook.recorded == len(hook.rows):
                return
            fresh = hook.rows[hook.recorded :]
            hook.recorded = len(hook.rows)
            self._add_gaps(fresh, leaf, LEAF_SHARED_REASON)
            if self.queued:  # a backward is running: its flush emits the gaps
                return
        self.flush()


class GradHook(HookObject):
    """Tensor hook bound to (sample, call, tensor_path) entries; never changes the gradient."""

    __slots__ = ("__weakref__", "leaf", "recorded", "rows", "shared", "state")

    def __init__(self, state: GradientState, row: int, *, leaf: bool = False) -> None:
        self.state = state
        self.leaf = leaf
        """Whether the hooked tensor is a leaf (its hook outlives the sample's graph)."""
        self.shared = False
        """A leaf that an earlier sampled forward returned too, before any backward reached
        it: one backward would sum both forwards' gradients."""
        self.rows = [row]
        """The forward entries (indices into the sample's forward rows) this gradient answers."""
        self.recorded = 0
        """How many of ``rows`` got their gradient (the first backward reaching them)."""

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.state.receive(self, grad)


class LeafHooks:
    """The pending hooks on leaf outputs of one observer: at most one per leaf tensor.

    Ownership: the observer's; each hook is removed after its first backward, when a later
    sampled forward hooks the same tensor (whose gradient would then mix both forwards), when
    the tensor is freed, or at :meth:`close` (``remove_observer``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(tensor) -> (the tensor, weakly; its pending hook; the hook's handle)
        self._pending: dict[int, tuple[weakref.ref[torch.Tensor], GradHook, RemovableHandle]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, tensor: torch.Tensor, hook: GradHook, handle: RemovableHandle) -> None:
        key = id(tensor)

        def forget(_: object, key: int = key) -> None:
            with self._lock:
                entry = self._pending.get(key)
                if entry is not None and entry[0]() is None:
                    del self._pending[key]

        with self._lock:
            replaced = self._pending.get(key)
            if replaced is not None and replaced[0]() is not tensor:
                replaced = None
            self._pending[key] = (weakref.ref(tensor, forget), hook, handle)
        if replaced is not None:
            hook.shared = True
            replaced[2].remove()
            replaced[1].state.unanswered(replaced[1], tensor)

    def discard(self, hook: GradHook) -> None:
        """Remove ``hook`` (it answered its backward)."""
        with self._lock:
            for key, (_, pending, handle) in list(self._pending.items()):
                if pending is hook:
                    del self._pending[key]
                    handle.remove()
                    return

    def close(self) -> None:
        """Remove every pending hook."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for _, _, handle in pending.values():
            handle.remove()


__all__ = ["LEAF_SHARED_REASON", "GradHook", "GradientState", "GradientTarget", "LeafHooks"]
