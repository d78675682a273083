"""``parameter_gradient``: a sample's parameters' ``.grad`` after the first backward that
reaches the sample (docs/capture.md, "Parameters, their gradients and their updates").

Ownership: a :class:`GradientWatch` belongs to one sample. While the sampled forward runs, the
sample's :class:`~ti_core.capture.parameters.ParameterSample` adds parameters to it and hooks
the module outputs (:class:`ReachedHook`); from then on only the autograd graph holds it,
through those hooks, like the output gradients' state (:mod:`~ti_core.capture.gradients`). Its
post-accumulate-grad hooks on the parameters hold it weakly. It removes them when the first
backward that reached the sample ends; a graph freed without a backward takes the watch with
it, and a finalizer removes them then; :meth:`ParameterCapture.close_hooks` removes any left at
observer removal.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, Final

import torch

from ti_core import _torch
from ti_core.call_context import now_us
from ti_core.capture.hooks import HookObject
from ti_core.capture.measured import add_entry, measured_entry
from ti_core.entries import Entry, Gaps
from ti_core.reduction.ended import EndedSignal, SignalTarget
from ti_core.reduction.sharding import local_tensor
from ti_core.stages import stage_of

GRADIENT_REENTRANT_REASON: Final[str] = (
    "parameter gradient not captured: reentrant activation checkpoint "
    "(use torch.utils.checkpoint(..., use_reentrant=False))"
)
GRADIENT_NONE_REASON: Final[str] = (
    "parameter gradient not captured: .grad was None at the end of the backward that reached "
    "the sampled forward (a hook consumed it, e.g. an optimizer step inside the backward)"
)


class PostAccumulateHook(HookObject):
    """Post-accumulate-grad hook of one watched parameter (sampled steps only)."""

    __slots__ = ("key", "watch")

    def __init__(self, watch: GradientWatch, key: int) -> None:
        self.watch = weakref.ref(watch)  # the graph owns the watch; the parameter must not
        self.key = key

    def __call__(self, param: torch.Tensor) -> None:
        watch = self.watch()
        if watch is not None:
            watch.accumulated(self.key)


class ReachedHook(HookObject):
    """Tensor hook on a module output of the sample: the backward reached the sample."""

    __slots__ = ("layer", "watch")

    def __init__(self, watch: GradientWatch, layer: int) -> None:
        self.watch = watch  # owned by the autograd graph, like GradientState
        self.layer = layer

    def __call__(self, grad: torch.Tensor | None) -> None:
        self.watch.reached(self.layer)


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class GradientWatch:
    """``parameter_gradient`` of one sample: which parameters the first backward that reaches
    the sample accumulates into, and their ``.grad`` when that backward has ended.

    Read at the very end of the backward (an engine callback queued from an engine callback),
    so gradients that others finish in their own end-of-backward callbacks are final:
    DistributedDataParallel's averaged gradients, FSDP2's reduce-scattered shards. Plain
    parameters count as accumulated when their post-accumulate-grad hook fires in that
    backward; a sharded (FSDP2) parameter, which the autograd graph never sees, when the
    backward reaches the output of a module holding it.
    """

    __slots__ = (
        "__weakref__",
        "_accumulated",
        "_done",
        "_entries",
        "_handles",
        "_lock",
        "_sharded",
        "_tasks",
        "forward_index",
        "layers",
        "sample_id",
        "target",
    )

    def __init__(
        self, target: weakref.ref[SignalTarget], sample_id: int, forward_index: int
    ) -> None:
        self.target = target
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.layers: set[int] = set()
        """Modules holding a watched parameter: their outputs tell that a backward came."""
        self._entries: dict[int, tuple[Entry, weakref.ref[torch.Tensor]]] = {}
        self._sharded: dict[int, list[int]] = {}
        self._handles: list[Any] = []
        self._tasks: set[int] = set()
        self._accumulated: dict[int, set[int]] = {}
        self._done = False
        self._lock = threading.Lock()
        handles = self._handles
        weakref.finalize(self, _remove_all, handles)  # graph freed without a backward

    def add(self, key: int, entry: Entry, param: torch.Tensor, layer: int, sharded: bool) -> None:
        """Watch ``param`` (requires grad), seen in the sample through selected module
        ``layer``."""
        self._entries[key] = (entry, weakref.ref(param))
        self.layers.add(layer)
        if sharded:
            self._sharded.setdefault(layer, []).append(key)
        else:
            hook = PostAccumulateHook(self, key)
            handle = param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
            self._handles.append(handle)

    def watch_outputs(self, layer: int, leaves: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Hook the outputs of a call of ``layer`` that a backward can reach (a tensor seen
        twice in one output is hooked once; a hook more is harmless, the first per backward
        counts)."""
        hooked: set[int] = set()
        for _, tensor in leaves:
            if tensor.requires_grad and tensor.grad_fn is not None and id(tensor) not in hooked:
                hooked.add(id(tensor))
                tensor.register_hook(ReachedHook(self, layer))  # type: ignore[no-untyped-call]

    def reached(self, layer: int) -> None:
        task = _torch.current_graph_task_id()
        with self._lock:
            if self._done:
                return
            done = self._accumulated.setdefault(task, set())
            done.update(self._sharded.get(layer, ()))
            if task in self._tasks:
                return
            self._tasks.add(task)
        _torch.queue_callback(lambda: self._queue_read(task))

    def accumulated(self, key: int) -> None:
        task = _torch.current_graph_task_id()
        with self._lock:
            if not self._done and task in self._tasks:
                self._accumulated[task].add(key)

    def _queue_read(self, task: int) -> None:
        # Callbacks queued while callbacks run go last: after DDP's and FSDP2's own, which were
        # queued earlier in this backward.
        _torch.queue_callback(lambda: self._read(task))

    def _read(self, task: int) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            keys = self._accumulated.pop(task, set())
            self._accumulated.clear()
        self.release()
        target = self.target()
        if target is None or target.closed:
            return
        try:
            batch = target.new_batch()
            gaps: list[tuple[Entry, str]] = []
            stamp = now_us()
            for key, (entry, ref) in self._entries.items():
                param = ref()
                if key not in keys or param is None:
                    continue
                grad = param.grad
                if grad is None:
                    gaps.append((entry, GRADIENT_NONE_REASON))
                    continue
                grad = local_tensor(grad)
                add_entry(batch, measured_entry(entry, grad, stamp), grad)
            if len(batch) or gaps:
                target.emit(
                    EndedSignal(
                        "parameter_gradient",
                        self.sample_id,
                        self.forward_index,
                        batch,
                        Gaps.of(gaps),
                    )
                )
        except Exception as error:
            target.errors.handle(stage_of("parameter_gradient", "capture"), error)

    def release(self) -> None:
        """Remove every post-accumulate-grad hook of this watch (idempotent)."""
        _remove_all(self._handles)


__all__ = [
    "GRADIENT_NONE_REASON",
    "GRADIENT_REENTRANT_REASON",
    "GradientWatch",
    "PostAccumulateHook",
    "ReachedHook",
]
