"""Parameters, their gradients and their updates: the opt-in signals ``parameter``,
``parameter_gradient`` and ``parameter_update`` (docs/capture.md, "Parameters, their gradients
and their updates").

Which parameters: those a selected module owns directly (``named_parameters(recurse=False)``),
found once at attach (:class:`ParameterCatalog`); one held by several selected modules is
reported under the first of them in traversal order. They are measured for the modules a sampled
forward calls, once per sample, at the first call of a module holding them.

Ownership: one :class:`ParameterCapture` per observer (the catalog, the update tracker of
:mod:`~ti_core.capture.updates`, every live gradient watch of
:mod:`~ti_core.capture.parameter_gradients`); the gate holds it, calls it at root forwards while
an update window waits, and has it remove its hooks at removal. One :class:`ParameterSample`
per sampled root forward, made with the :class:`~ti_core.capture.sample.Sample` and living as
long: it snapshots the values (``parameter``, emitted with the forward) and hands the
parameters to the sample's gradient watch and update window. Nothing of this exists between
samples.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ti_core import _torch
from ti_core.call_context import in_reentrant_checkpoint, now_us
from ti_core.capture.measured import add_entry
from ti_core.capture.parameter_gradients import GRADIENT_REENTRANT_REASON, GradientWatch
from ti_core.capture.updates import (
    DEFAULT_UPDATE_BUDGET_BYTES,
    OptimizerHookHost,
    UpdateTracker,
    UpdateWindow,
)
from ti_core.entries import Entry, Gaps
from ti_core.reduction.batch import TensorBatch
from ti_core.reduction.ended import EndedSignal, SignalTarget
from ti_core.reduction.sharding import is_sharded, local_tensor, parameter_path
from ti_core.reduction.support import dtype_name
from ti_core.stages import stage_of
from ti_schema import PARAMETER_SIGNALS


@dataclass(frozen=True, slots=True)
class HeldParameter:
    """One parameter of the run: who reports it and how it is found."""

    owner: int
    """Index of the selected module its rows are reported under (the ``layer``)."""
    attribute: str
    """Its name in the owner module."""
    path: str
    """Its ``tensor_path`` (:func:`parameter_path`)."""
    key: int
    """``id`` of the parameter at attach."""
    param: weakref.ref[torch.Tensor]
    module: weakref.ref[nn.Module]
    """The owner module."""
    sharded: bool
    """A DTensor at attach (FSDP2): the registered shard is measured, not what the module holds
    while its forward runs (the gathered parameter)."""


class ParameterCatalog:
    """The directly owned parameters of every selected module, found once at attach."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        owners: dict[int, HeldParameter] = {}
        held: list[tuple[HeldParameter, ...]] = []
        for layer, module in enumerate(modules):
            row = []
            for name, param in module.named_parameters(recurse=False):
                found = owners.get(id(param))
                if found is None:
                    found = HeldParameter(
                        owner=layer,
                        attribute=name,
                        path=parameter_path(name, param),
                        key=id(param),
                        param=weakref.ref(param),
                        module=weakref.ref(module),
                        sharded=is_sharded(param),
                    )
                    owners[id(param)] = found
                row.append(found)
            held.append(tuple(row))
        self.held: tuple[tuple[HeldParameter, ...], ...] = tuple(held)
        """Per selected module (by layer index), the parameters it holds directly."""

    def __len__(self) -> int:
        return len({h.key for row in self.held for h in row})

    @staticmethod
    def resolve(held: HeldParameter) -> torch.Tensor | None:
        """The parameter to measure now: the one registered at attach, unless the module holds
        a new one under that name (replaced by the user). A sharded parameter is always the
        registered shard: while a module's forward runs, FSDP2 puts the gathered parameter in
        its place."""
        attached = held.param()
        if attached is not None and held.sharded:
            return attached
        module = held.module()
        current = None if module is None else _torch.own_parameter(module, held.attribute)
        return attached if current is None else current


class ParameterCapture:
    """The parameter signals of one observer: the catalog, the update tracker, every live
    gradient watch (for removal)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        signals: Sequence[str],
        target: weakref.ref[SignalTarget],
        update_budget_bytes: int = DEFAULT_UPDATE_BUDGET_BYTES,
    ) -> None:
        self.catalog = ParameterCatalog(modules)
        self.values = "parameter" in signals
        self.gradients = "parameter_gradient" in signals
        self.updates = "parameter_update" in signals
        self.states = "optimizer_state" in signals
        if not (self.values or self.gradients or self.updates or self.states):
            raise ValueError(
                f"ParameterCapture needs one of {(*PARAMETER_SIGNALS, 'optimizer_state')}, got "
                f"{signals}"
            )
        self._target = target
        self.tracker = (
            UpdateTracker(target, update_budget_bytes, updates=self.updates, states=self.states)
            if self.updates or self.states
            else None
        )
        self._watches: weakref.WeakSet[GradientWatch] = weakref.WeakSet()

    @property
    def waiting(self) -> bool:
        """The gate calls :meth:`root_forward` at the next root forward."""
        tracker = self.tracker
        return tracker is not None and tracker.waiting

    def bind(self, host: OptimizerHookHost) -> None:
        """Where the optimizer hooks are installed (the gate's ``OptimizerHooks``)."""
        if self.tracker is not None:
            self.tracker.bind(host)

    def start(self, sample_id: int, forward_index: int) -> ParameterSample:
        """The parameter side of a sampled root forward."""
        values = None
        if self.values:
            target = self._target()
            values = None if target is None else target.new_batch()
        return ParameterSample(self, sample_id, forward_index, values)

    def root_forward(self) -> None:
        if self.tracker is not None:
            self.tracker.root_forward()

    def watching(self, watch: GradientWatch) -> None:
        self._watches.add(watch)

    def close_hooks(self) -> None:
        """Remove every post-accumulate-grad hook of live gradient watches (the gate, at
        removal; it removes the optimizer step hooks itself)."""
        for watch in list(self._watches):
            watch.release()

    def flush(self) -> list[EndedSignal]:
        """At removal, after the hooks: the unavailable rows of the update windows still open
        (the observer emits them before closing its sinks)."""
        return [] if self.tracker is None else self.tracker.close()


class ParameterSample:
    """The parameter signals of one sampled root forward."""

    __slots__ = (
        "_capture",
        "_gaps",
        "_seen",
        "_values",
        "_watch",
        "_window",
        "forward_index",
        "sample_id",
    )

    def __init__(
        self,
        capture: ParameterCapture,
        sample_id: int,
        forward_index: int,
        values: TensorBatch | None,
    ) -> None:
        self._capture = capture
        self.sample_id = sample_id
        self.forward_index = forward_index
        self._values = values
        self._seen: set[int] = set()
        self._gaps: list[tuple[Entry, str]] = []
        self._watch: GradientWatch | None = None
        self._window: UpdateWindow | None = None

    def record_call(
        self, layer: int, module: nn.Module, leaves: Sequence[tuple[str, torch.Tensor]]
    ) -> None:
        """A call of selected module ``layer`` returned: measure the parameters it holds that
        this sample has not seen yet; hook its outputs for the gradient watch."""
        capture = self._capture
        held = capture.catalog.held[layer]
        if not held:
            return
        try:
            grad_enabled = torch.is_grad_enabled()
            fresh = [h for h in held if h.key not in self._seen]
            if fresh:
                self._record(layer, fresh, bool(module.training), grad_enabled)
            watch = self._watch
            if watch is not None and grad_enabled and layer in watch.layers:
                watch.watch_outputs(layer, leaves)
        except Exception as error:
            target = capture._target()
            if target is not None:
                target.errors.handle(stage_of("parameter", "capture"), error)

    def _record(
        self, layer: int, fresh: Sequence[HeldParameter], train: bool, grad_enabled: bool
    ) -> None:
        capture = self._capture
        stamp = now_us()
        reentrant: bool | None = None
        for held in fresh:
            self._seen.add(held.key)
            param = capture.catalog.resolve(held)
            if param is None:
                continue
            value = local_tensor(param)
            entry = Entry(
                held.owner,
                0,
                held.path,
                train,
                grad_enabled,
                tuple(value.shape),
                dtype_name(value.dtype),
                stamp,
            )
            if self._values is not None:
                add_entry(self._values, entry, value)
            if capture.gradients and param.requires_grad:
                if grad_enabled:
                    self._gradient_watch().add(held.key, entry, param, layer, held.sharded)
                else:
                    if reentrant is None:
                        reentrant = in_reentrant_checkpoint()
                    if reentrant:
                        self._gaps.append((entry, GRADIENT_REENTRANT_REASON))
            if capture.tracker is not None:
                capture.tracker.add(self._update_window(), held.key, entry, param)

    def _gradient_watch(self) -> GradientWatch:
        if self._watch is None:
            self._watch = GradientWatch(self._capture._target, self.sample_id, self.forward_index)
            self._capture.watching(self._watch)
        return self._watch

    def _update_window(self) -> UpdateWindow:
        if self._window is None:
            self._window = UpdateWindow(self.sample_id, self.forward_index)
            tracker = self._capture.tracker
            assert tracker is not None
            tracker.open(self._window)
        return self._window

    def forward_done(self) -> EndedSignal | None:
        """The root forward returned: the ``parameter`` snapshots with the ``parameter_gradient``
        coverage gaps, if either holds anything. From now on only the autograd graph holds the
        gradient watch."""
        self._watch = None
        self._window = None
        values, gaps = self._values, self._gaps
        if values is None and not gaps:
            return None
        if values is None:
            target = self._capture._target()
            if target is None:
                return None
            values = target.new_batch()
        return EndedSignal(
            "parameter",
            self.sample_id,
            self.forward_index,
            values,
            Gaps.of(gaps),
            gap_signal="parameter_gradient",
        )


__all__ = ["HeldParameter", "ParameterCapture", "ParameterCatalog", "ParameterSample"]
