"""One sampled root forward and the recording of each selected module call during it.

Ownership: a :class:`Sample` is created by the gate when a sampled root forward starts (made by
the observer), lives in the thread-local state of the thread running that forward, and ends
when the root forward returns (:meth:`Sample.end`: its forward signals go to its target). Only
its gradient state (:mod:`ti_core.capture.gradients`) outlives it, on the autograd graph.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Collection
from typing import Any, Final

import torch
from torch import nn

from ti_core.call_context import in_reentrant_checkpoint
from ti_core.call_signals import CallSignal
from ti_core.capture.attention import AttentionCalls
from ti_core.capture.gradients import GradientState, GradientTarget
from ti_core.capture.parameters import ParameterSample
from ti_core.entries import Gaps
from ti_core.reduction.batch import TensorBatch
from ti_core.reduction.ended import EndedSignal
from ti_core.reduction.sharding import leaf_path
from ti_core.stages import stage_of
from ti_core.tensor_paths import tensor_leaves
from ti_schema import DEFAULT_SIGNALS

LEAF_REASON: Final[str] = (
    "gradient not captured: the output is a leaf tensor (the module returned an input or "
    "parameter unchanged)"
)
"""In compiled graphs, which hook gradients inside the graph: a leaf has none there. Eager
capture hooks the leaf itself (:meth:`GradientState.watch_leaf`)."""
REENTRANT_REASON: Final[str] = (
    "gradient not captured: reentrant activation checkpoint "
    "(use torch.utils.checkpoint(..., use_reentrant=False))"
)

_EMISSION: Final = stage_of("output", "emission")
_ATTENTION: Final = stage_of("attention", "capture")


_time_ns = time.time_ns
_is_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor


class Sample:
    """One sampled root forward: its outputs, its coverage gaps and its gradient state, and the
    parameter side when the parameter signals are on.

    :meth:`record` runs for every selected module call of a sampled forward, so it creates no
    Python object per call: entries are appended to the batch's columns, the gradient hook is
    shared by every entry of one tensor.

    ``signals`` are the signals recorded (``inject_observer(signals=)``); this class records
    ``output`` and ``output_gradient``, the call signals (``input``: :meth:`record_start`),
    and hands the parameter signals to ``parameters``.
    """

    __slots__ = (
        "abandoned",
        "attention",
        "calls",
        "forward",
        "forward_index",
        "gaps",
        "gradients",
        "open_starts",
        "output_gradients",
        "outputs",
        "parameters",
        "sample_id",
        "signals",
        "snapshots",
        "starts",
        "target",
    )

    def __init__(
        self,
        sample_id: int,
        forward_index: int,
        batch: TensorBatch,
        target: weakref.ref[GradientTarget],
        *,
        signals: Collection[str] = DEFAULT_SIGNALS,
        parameters: ParameterSample | None = None,
        attention: dict[int, int] | None = None,
        call_signals: tuple[CallSignal, ...] = (),
    ) -> None:
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.target = target
        """Where this sample's gradients go (held weakly, as by the gradient state)."""
        self.calls: dict[int, int] = {}
        self.forward = batch
        """The outputs recorded so far."""
        self.gaps = Gaps()
        """Outputs whose gradient cannot be captured, with the reason."""
        self.gradients: GradientState | None = None
        self.signals = frozenset(signals)
        # Read at every recorded call: derived once from ``signals``.
        self.outputs = "output" in self.signals
        self.output_gradients = "output_gradient" in self.signals
        self.snapshots = self.outputs or self.output_gradients
        """Whether outputs are snapshot: as the ``output`` rows, or for the gradient rows to
        take their identity from."""
        self.parameters = parameters
        """The parameter signals of this forward (None when they are off)."""
        self.starts: tuple[tuple[CallSignal, TensorBatch], ...] = ()
        """Each call signal recorded (``input``, :mod:`ti_core.capture.signals`), with the
        batch of its tensors."""
        self.open_starts: dict[int, list[list[tuple[TensorBatch, int]]]] = {}
        """Per layer, the calls that started and have not returned, innermost last: the
        entries each added to the call signals' batches. A call's entries take its output's
        call index when it returns (:meth:`close_start`); a call that never returns leaves
        them in :attr:`abandoned`."""
        self.abandoned: list[tuple[TensorBatch, int]] = []
        """Call-signal entries of calls that raised: dropped when the sample ends."""
        if call_signals:
            owner = target()
            if owner is not None:
                self.starts = tuple((signal, owner.new_batch()) for signal in call_signals)
        self.attention: AttentionCalls | None = None
        """The attention calls of this forward, intercepted while it runs (``attention``
        given the selected modules by id: the signal is on)."""
        if attention is not None:
            target_now = target()
            if target_now is not None:
                errors = target_now.errors
                self.attention = AttentionCalls(
                    attention,
                    self.calls,
                    target_now.new_batch(),
                    lambda error: errors.handle(_ATTENTION, error),
                )
                self.attention.start()

    def record(self, layer: int, module: nn.Module, output: Any) -> None:
        """One call of the selected module ``layer`` returned ``output``: snapshot each tensor
        and, where a gradient will flow back into it, hook that gradient."""
        calls = self.calls
        call = calls.get(layer, 0)
        calls[layer] = call + 1
        if self.starts:
            self.close_start(layer, call)
        if isinstance(output, _Tensor):
            path = "" if type(output) is _Tensor else leaf_path("", output)
            if self.parameters is not None:
                self.parameters.record_call(layer, module, [(path, output)])
            if self.snapshots:
                self._record(layer, call, path, bool(module.training), output, _time_ns() // 1000)
            return
        leaves = [
            (p if type(t) is _Tensor else leaf_path(p, t), t) for p, t in tensor_leaves(output)
        ]
        if self.parameters is not None:
            self.parameters.record_call(layer, module, leaves)
        if not leaves or not self.snapshots:
            return
        stamp = _time_ns() // 1000
        train = bool(module.training)
        for path, tensor in leaves:
            self._record(layer, call, path, train, tensor, stamp)

    def record_start(
        self, layer: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A call of the selected module ``layer`` starts with ``args`` and ``kwargs``: snapshot
        each call signal's tensors among them, before the forward can change them in place
        (their call index is the output's, given when the call returns)."""
        stamp = _time_ns() // 1000
        train = bool(module.training)
        grad_enabled = _is_grad_enabled()
        added: list[tuple[TensorBatch, int]] = []
        for signal, batch in self.starts:
            try:
                for path, tensor in signal.source(args, kwargs, tensor_leaves):
                    if type(tensor) is not _Tensor:
                        path = leaf_path(path, tensor)
                    batch.add(tensor, layer, 0, path, train, grad_enabled, stamp)
                    added.append((batch, len(batch.rows) - 1))
            except Exception as error:
                self.start_failed(signal, error)
        self.open_starts.setdefault(layer, []).append(added)

    def close_start(self, layer: int, call: int) -> None:
        """The innermost open call of ``layer`` returned as call ``call``: its call-signal
        entries take that index."""
        stack = self.open_starts.get(layer)
        if stack:
            for batch, row in stack.pop():
                batch.renumber(row, call)

    def abandon_start(self, layer: int) -> None:
        """The innermost open call of ``layer`` raised: its call-signal entries are dropped
        (there is no call index to give them)."""
        stack = self.open_starts.get(layer)
        if stack:
            self.abandoned += stack.pop()

    def _drop_unreturned(self) -> None:
        """Drop the call-signal entries of calls that raised or never returned."""
        dropped = self.abandoned
        for stack in self.open_starts.values():
            for added in stack:
                dropped += added
        self.open_starts = {}
        self.abandoned = []
        for _, batch in self.starts:
            rows = [row for owner, row in dropped if owner is batch]
            if rows:
                batch.discard(rows)

    def start_failed(self, signal: CallSignal, error: Exception) -> None:
        """Recording ``signal`` at a call's start raised: to the error policy, as that
        signal's capture (the other signals, and the call's output, are still recorded)."""
        target = self.target()
        if target is not None:
            target.errors.handle(stage_of(signal.name, "capture"), error)

    def _record(
        self, layer: int, call: int, path: str, train: bool, tensor: torch.Tensor, stamp: int
    ) -> None:
        grad_enabled = _is_grad_enabled()
        forward = self.forward
        slot = forward.add(tensor, layer, call, path, train, grad_enabled, stamp)
        if not self.output_gradients:
            return
        if grad_enabled:
            if not tensor.requires_grad:
                return
            row = len(forward.rows) - 1
            gradients = self.gradients
            if gradients is None:
                gradients = self.gradients = GradientState(
                    self.target, self.sample_id, self.forward_index, forward.rows
                )
            if tensor.is_leaf:  # requires grad without a grad_fn: its hook lives on the tensor
                gradients.watch_leaf(row, slot, tensor)
            else:
                gradients.watch(row, slot, tensor)
        elif (tensor.is_floating_point() or tensor.is_complex()) and in_reentrant_checkpoint():
            self.gaps.add(forward.entry(len(forward.rows) - 1), REENTRANT_REASON)

    def end(self) -> None:
        """The root forward returned (or raised): no more gradient hooks will be registered;
        hand its ``output`` signal (with the outputs whose gradient cannot be captured) and its
        ``parameter`` signal to the target."""
        attention = self.attention
        if attention is not None:
            self.attention = None
            try:
                attention.stop()
            except Exception as error:  # a mode the forward entered and left open
                attention.gaps = Gaps()
                target = self.target()
                if target is not None:
                    target.errors.handle(_ATTENTION, error)
        target = self.target()
        if target is None:  # pragma: no cover - the observer holds the gate that holds this
            return
        try:
            if self.starts:
                self._drop_unreturned()
            for signal, batch in self.starts:
                if len(batch):
                    ended = EndedSignal(signal.name, self.sample_id, self.forward_index, batch)
                    target.emit(ended)
            if attention is not None and (len(attention.batch) or attention.gaps):
                target.emit(
                    EndedSignal(
                        "attention",
                        self.sample_id,
                        self.forward_index,
                        attention.batch,
                        attention.gaps,
                    )
                )
            if self.gradients is not None:
                self.gradients.forward_done()
            if self.outputs or self.gaps:
                # without the output signal the forward rows exist only for the gradients to
                # derive their identity from: they are not emitted
                batch = self.forward if self.outputs else target.new_batch()
                ended = EndedSignal(
                    "output",
                    self.sample_id,
                    self.forward_index,
                    batch,
                    self.gaps,
                    gap_signal="output_gradient",
                )
                target.emit(ended)
            if self.parameters is not None:
                parameters = self.parameters.forward_done()
                if parameters is not None:
                    target.emit(parameters)
        except Exception as error:
            target.errors.handle(_EMISSION, error)


__all__ = ["LEAF_REASON", "REENTRANT_REASON", "Sample"]
