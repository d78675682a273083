"""The observer: one per observed model, stored privately in the model's ``__dict__``.

Lifecycle: created and attached by ``inject_observer`` (sinks already open), detached by
``remove_observer`` (every hook and override removed, every sink closed once). Between those it
owns the root hooks permanently and the per-module capture only while a sampled forward runs
(installed at the first sampled root forward, removed at the next unsampled one or at removal).
Per-thread state (nesting depth, the current sample) lives in a ``threading.local``.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

import pyarrow as pa
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ti_core.capture import (
    SNAPSHOT_BUDGET_BYTES,
    CallHook,
    GradientState,
    Reduced,
    RootPostHook,
    RootPreHook,
    TensorBatch,
    install_forward_override,
    tensor_leaves,
)
from ti_core.context import dtype_name, in_backward, in_reentrant_checkpoint, now_us
from ti_core.emission import EmissionWorker
from ti_core.errors import SINK_CONSEQUENCE, ErrorPolicy
from ti_core.records import (
    Entry,
    RunColumns,
    histogram_batch,
    history_batch,
    unavailable_batch,
)
from ti_core.sampling import Sampler
from ti_core.sink import RunInfo, Sink, sink_capabilities
from ti_core.snapshots import SnapshotPool

if TYPE_CHECKING:
    from ti_core.reducers import ReductionPlan

ATTRIBUTE: Final[str] = "_ti_observer"
"""Key of the observer in the model's ``__dict__`` (never a submodule, parameter or buffer)."""

LEAF_REASON: Final[str] = (
    "gradient not captured: the output is a leaf tensor (the module returned an input or "
    "parameter unchanged)"
)
REENTRANT_REASON: Final[str] = (
    "gradient not captured: reentrant activation checkpoint "
    "(use torch.utils.checkpoint(..., use_reentrant=False))"
)


class _ThreadState(threading.local):
    depth = 0
    outer: FrameType | None = None
    sample: _Sample | None = None


def _has_ancestor(frame: FrameType, target: FrameType | None) -> bool:
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Sample:
    """One sampled root forward, owned by the thread running it until the root returns."""

    __slots__ = ("calls", "forward", "forward_index", "gaps", "gradients", "sample_id")

    def __init__(self, sample_id: int, forward_index: int, batch: TensorBatch) -> None:
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.calls: dict[int, int] = {}
        self.forward = batch
        self.gaps: list[tuple[Entry, str]] = []
        self.gradients: GradientState | None = None


class Observer:
    """Capture state of one ``inject_observer`` call."""

    def __init__(
        self,
        *,
        root: nn.Module,
        modules: Sequence[nn.Module],
        focus: Sequence[int],
        run: RunInfo,
        sinks: Sequence[Sink],
        sampler: Sampler,
        plan: ReductionPlan,
        errors: ErrorPolicy,
        capture_direct_forwards: bool,
        columns: RunColumns,
        background: bool = False,
    ) -> None:
        self.run = run
        self.errors = errors
        self.closed = False
        self._root_ref = weakref.ref(root)
        self._modules = [weakref.ref(m) for m in modules]
        self._root_layer = next((i for i, m in enumerate(modules) if m is root), None)
        self._focus = frozenset(focus)
        self._sinks = tuple(sinks)
        self._sampler = sampler
        self._plan = plan
        self._direct = capture_direct_forwards
        self._columns = columns
        self._local = _ThreadState()
        self._lock = threading.Lock()
        self._emit_lock = threading.Lock()
        self._counter = itertools.count()
        self._samples = 0
        self._active = 0
        self._installed = False
        self._undo: list[Callable[[], None]] = []
        self._root_handles: list[RemovableHandle] = []
        self._sinks_closed = False
        self._pool = SnapshotPool()
        # Reductions and writes of host tensors run on this worker (None: on the thread whose
        # forward or backward ended). Started by the first job, closed by ``detach``.
        self._worker = (
            EmissionWorker(f"ti-core emission {run.run_id}", max_bytes=SNAPSHOT_BUDGET_BYTES)
            if background
            else None
        )
        if background:
            _with_worker.add(self)

    # Copies of a model (deepcopy, pickle, torch.save) carry no observer: this becomes None.
    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        return (type(None), ())

    def __repr__(self) -> str:
        return (
            f"<ti_core Observer run_id={self.run.run_id} layers={len(self._modules)} "
            f"sampler={self.run.sampler}{' closed' if self.closed else ''}>"
        )

    # ------------------------------------------------------------------ attach / detach

    def attach(self, root: nn.Module) -> None:
        self._root_handles = [
            root.register_forward_pre_hook(RootPreHook(self), prepend=True),
            root.register_forward_hook(RootPostHook(self), always_call=True),
        ]
        if self._worker is not None:
            barrier = _barrier(self)
            for sink in self._sinks:
                on_barrier = sink_capabilities(sink).on_barrier
                if on_barrier is not None:
                    on_barrier(barrier)

    @property
    def emission_thread(self) -> threading.Thread | None:
        """The thread reducing and writing sampled signals (None: inline, or idle/not started)."""
        return self._worker.thread if self._worker is not None else None

    def drain(self) -> None:
        """Wait until every signal that ended so far is reduced and written to the sinks, and
        report the failures that happened meanwhile (on this thread)."""
        if self._worker is not None:
            self._worker.drain()
        if self.errors.has_deferred:
            self.errors.report_deferred()

    def detach(self) -> list[tuple[Sink, BaseException]]:
        """Remove every hook and override, close every sink once; return close errors."""
        with self._lock:
            self.closed = True
            for handle in self._root_handles:
                handle.remove()
            self._root_handles = []
            self._uninstall_locked()
        if self._worker is not None:
            self._worker.close()  # runs every queued signal first: nothing measured is lost
            if self.errors.has_deferred:
                self.errors.report_deferred()
        failures: list[tuple[Sink, BaseException]] = []
        with self._emit_lock:
            self._sinks_closed = True
            for sink in self._sinks:
                try:
                    sink.close()
                except Exception as error:
                    failures.append((sink, error))
        return failures

    def _install_locked(self) -> None:
        for layer, ref in enumerate(self._modules):
            module = ref()
            if module is None or layer == self._root_layer:
                continue
            if self._direct:
                self._undo.append(install_forward_override(self, layer, module))
            else:
                self._undo.append(module.register_forward_hook(CallHook(self, layer)).remove)
        self._installed = True

    def _uninstall_locked(self) -> None:
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            step()
        self._installed = False

    # ------------------------------------------------------------------ root boundary

    def root_enter(self, caller: FrameType | None = None) -> None:
        """Forward pre-hook of the root: decide whether this root forward is sampled.

        ``caller`` is the frame that runs the root's hooks; it tells a genuinely nested root call
        from state left behind by a root forward that a BaseException (KeyboardInterrupt)
        interrupted, which skips the always-called forward hook.
        """
        local = self._local
        depth = local.depth
        if depth and caller is not None and not _has_ancestor(caller, local.outer):
            self._abandon(local)
            depth = 0
        local.depth = depth + 1
        if depth:
            return
        local.outer = caller
        if self.closed or in_backward():
            return
        if self.errors.has_deferred:
            self.errors.report_deferred()
        index = next(self._counter)
        try:
            if not self._sampler.should_sample(index):
                if self._installed and not self._active:
                    with self._lock:
                        if self._installed and not self._active:
                            self._uninstall_locked()
                return
            with self._lock:
                if self.closed:
                    return
                sample_id = self._samples
                self._samples += 1
                self._active += 1
                if not self._installed:
                    self._install_locked()
            local.sample = _Sample(sample_id, index, self.new_batch())
        except Exception as error:
            self.errors.handle("sampling", error)

    def _abandon(self, local: _ThreadState) -> None:
        """Drop the state of an interrupted root forward of this thread."""
        local.depth = 0
        local.outer = None
        if local.sample is not None:
            local.sample = None
            with self._lock:
                self._active -= 1

    def root_exit(self, module: nn.Module, output: Any) -> None:
        """Forward hook of the root (also runs when the forward raised): emit the sample."""
        local = self._local
        if local.depth > 0:
            local.depth -= 1
        if not local.depth:
            local.outer = None
        sample = local.sample
        if sample is None:
            return
        if self._root_layer is not None:
            self.capture(self._root_layer, module, output)
        if local.depth:
            return
        local.sample = None
        with self._lock:
            self._active -= 1
        if self.closed:
            return
        try:
            self._finish_forward(sample)
        except Exception as error:
            self.errors.handle("forward emission", error)

    # ------------------------------------------------------------------ per call

    def capture(self, layer: int, module: nn.Module, output: Any) -> None:
        """One call of a selected module during a sampled forward of this thread."""
        sample = self._local.sample
        if sample is None or in_backward():
            return
        try:
            self._record(sample, layer, module, output)
        except Exception as error:
            self.errors.handle("output capture", error)

    def _record(self, sample: _Sample, layer: int, module: nn.Module, output: Any) -> None:
        call = sample.calls.get(layer, 0)
        sample.calls[layer] = call + 1
        leaves = tensor_leaves(output)
        if not leaves:
            return
        stamp = now_us()
        train = bool(module.training)
        grad_enabled = torch.is_grad_enabled()
        reentrant: bool | None = None
        for path, tensor in leaves:
            entry = Entry(
                layer,
                call,
                path,
                train,
                grad_enabled,
                tuple(tensor.shape),
                dtype_name(tensor.dtype),
                stamp,
            )
            sample.forward.add(entry, tensor)
            if grad_enabled and tensor.requires_grad:
                if tensor.grad_fn is None:
                    sample.gaps.append((entry, LEAF_REASON))
                else:
                    if sample.gradients is None:
                        sample.gradients = GradientState(
                            self, sample.sample_id, sample.forward_index
                        )
                    sample.gradients.watch(entry, tensor)
            elif not grad_enabled and (tensor.is_floating_point() or tensor.is_complex()):
                if reentrant is None:
                    reentrant = in_reentrant_checkpoint()
                if reentrant:
                    sample.gaps.append((entry, REENTRANT_REASON))

    # ------------------------------------------------------------------ emission

    def new_batch(self) -> TensorBatch:
        return TensorBatch(self._plan, self._focus, pool=self._pool)

    def _finish_forward(self, sample: _Sample) -> None:
        if sample.gradients is not None:
            sample.gradients.forward_done()
        # The job holds only what it emits: the sample's gradient state must stay free to go
        # with the autograd graph when no backward comes.
        batch, sample_id, index, gaps = (
            sample.forward,
            sample.sample_id,
            sample.forward_index,
            sample.gaps,
        )
        self._dispatch(
            batch, lambda: self._emit_forward(batch, sample_id, index, gaps), "forward emission"
        )

    def _dispatch(self, batch: TensorBatch, job: Callable[[], None], stage: str) -> None:
        """Run ``job`` (reduce and emit ``batch``) on the emission worker when it can take it,
        else here; either way after every job dispatched before it."""
        worker = self._worker
        if worker is not None:
            if batch.host_only:

                def background() -> None:
                    with self.errors.deferred():
                        try:
                            job()
                        except Exception as error:
                            self.errors.handle(stage, error)

                if worker.submit(background, batch.pending_bytes):
                    return
            worker.drain()  # keep the sinks' order: earlier signals first
        job()

    def _emit_forward(
        self,
        forward: TensorBatch,
        sample_id: int,
        forward_index: int,
        gaps: list[tuple[Entry, str]],
    ) -> None:
        self._emit("output", sample_id, forward_index, forward.finish())
        if gaps:
            batch = unavailable_batch(
                self._columns,
                "output_gradient",
                sample_id,
                forward_index,
                [e for e, _ in gaps],
                [r for _, r in gaps],
            )
            self._write("history", batch)

    def finish_gradients(self, state: GradientState, batch: TensorBatch) -> None:
        """End of a backward that reached ``state``'s sample (autograd engine callback)."""
        sample_id, index = state.sample_id, state.forward_index
        try:
            self._dispatch(
                batch,
                lambda: self._emit("output_gradient", sample_id, index, batch.finish()),
                "gradient emission",
            )
        except Exception as error:
            self.errors.handle("gradient emission", error)

    def _emit(self, signal: str, sample_id: int, forward_index: int, reduced: Reduced) -> None:
        if reduced.entries:
            batch = history_batch(
                self._columns,
                signal,
                sample_id,
                forward_index,
                reduced.entries,
                reduced.values,
                reduced.available,
                reduced.reasons,
            )
            self._write("history", batch)
        if reduced.histograms:
            hist = histogram_batch(
                self._columns,
                signal,
                sample_id,
                forward_index,
                reduced.histogram_entries,
                reduced.histograms,
            )
            self._write("histograms", hist)
        for error in reduced.errors:
            self.errors.handle("reduction", error)

    def _write(self, kind: str, batch: pa.RecordBatch) -> None:
        with self._emit_lock:
            if self._sinks_closed:
                return
            for sink in self._sinks:
                try:
                    if kind == "history":
                        sink.write_history(batch)
                    else:
                        sink.write_histograms(batch)
                except Exception as error:
                    self.sink_failed(sink, "writing to", error)

    def sink_failed(self, sink: Sink, action: str, error: BaseException) -> None:
        """One sink's write or close failed: under ``warn``, one warning per sink and error
        type for the whole run (a broken directory fails every later write and the close)."""
        self.errors.handle(
            f"{action} {type(sink).__name__}",
            error,
            key=("sink", id(sink)),
            consequence=SINK_CONSEQUENCE,
        )


_with_worker: weakref.WeakSet[Observer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The emission worker may have held the sink lock at the fork; no other thread exists in
    # the child, so a fresh lock is safe (the worker resets its own state, see emission.py).
    for observer in list(_with_worker):
        observer._emit_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _barrier(observer: Observer) -> Callable[[], None]:
    """What a sink calls before serving reads: waits for the observer's queued signals.

    Holds the observer weakly, so a sink kept after the run does not keep the observer alive.
    """
    ref = weakref.ref(observer)

    def barrier() -> None:
        live = ref()
        if live is not None and live._worker is not None:
            live._worker.drain()

    return barrier


__all__ = ["ATTRIBUTE", "Observer", "dtype_name"]
