"""``parameter_update``: what the first optimizer step after a sampled forward changes in each
of its parameters; ``optimizer_state``: the Adam-type state that step leaves for each of them
(docs/capture.md, "Parameters, their gradients and their updates", "Optimizer state").

Ownership: one :class:`UpdateTracker` per observer (with the parameter signals on). Each sampled
forward opens an :class:`UpdateWindow` and adds its parameters to it. torch's global optimizer
step pre/post hooks (:class:`OptimizerStepHook`) are installed by the gate, through
:class:`OptimizerHookHost`, when a window opens; they copy the values a step is about to change
(within ``update_budget_bytes`` at any time) and measure value after minus value before. A
window closes once every parameter in it was updated (and its state read), else at the first
root forward after an optimizer step (its other parameters get unavailable rows), or at removal
(:meth:`close`). The state is read in the post-step hook, from ``optimizer.state``: no copy. When
no window is left the gate removes the hooks, at that root forward: never from inside a hook,
while torch iterates them.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import CodeType
from typing import Any, Final, Protocol

import torch

from ti_core.call_context import now_us
from ti_core.capture.hooks import HookObject
from ti_core.capture.measured import add_entry, measured_entry
from ti_core.entries import Entry, Gaps
from ti_core.reduction.batch import TensorBatch
from ti_core.reduction.ended import EndedSignal, SignalTarget
from ti_core.reduction.sharding import local_tensor
from ti_core.stages import stage_of
from ti_schema import Signal

DEFAULT_UPDATE_BUDGET_BYTES: Final[int] = 256 * 2**20
"""Default of ``inject_observer(update_budget_bytes=)``: bytes of parameter values copied before
optimizer steps, held at any one time, to measure ``parameter_update``."""

NO_OPTIMIZER_REASON: Final[str] = (
    "parameter update not measured: no optimizer that stepped after the sampled forward holds "
    "this parameter"
)
REMOVED_REASON: Final[str] = (
    "parameter update not measured: the observer was removed before an optimizer step "
    "updated this parameter"
)
STATE_PARTS: Final[tuple[str, ...]] = ("exp_avg", "exp_avg_sq", "grad_sq_over_v")
"""The ``optimizer_state`` tensors of a parameter, each a ``tensor_path`` suffix."""
STATE_NO_OPTIMIZER_REASON: Final[str] = (
    "optimizer state not measured: no optimizer that stepped after the sampled forward holds "
    "this parameter"
)
STATE_REMOVED_REASON: Final[str] = (
    "optimizer state not measured: the observer was removed before an optimizer step "
    "updated this parameter"
)
NO_MOMENTS_REASON: Final[str] = (
    "optimizer state not measured: {optimizer} holds no exp_avg and exp_avg_sq for this "
    "parameter (Adam, AdamW and other Adam-type optimizers do)"
)
NO_GRADIENT_REASON: Final[str] = (
    "optimizer state not measured: the parameter had no gradient at the step (or its optimizer "
    "group names no betas and its state no step)"
)


def state_path(path: str, part: str) -> str:
    """The ``tensor_path`` of a parameter's optimizer-state tensor ``part``: ``weight.exp_avg``;
    a DTensor's placements stay last (``weight.exp_avg@S(0)``)."""
    at = path.find("@")
    return f"{path}.{part}" if at < 0 else f"{path[:at]}.{part}{path[at:]}"


def _state_entry(entry: Entry, part: str, tensor: torch.Tensor | None, stamp: int) -> Entry:
    """``entry`` (a parameter's) for its state tensor ``part`` at ``stamp``: measured on
    ``tensor`` when there is one."""
    named = replace(entry, path=state_path(entry.path, part), timestamp_us=stamp)
    return named if tensor is None else measured_entry(named, tensor, stamp)


def optimizer_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, entry: Entry, stamp: int
) -> tuple[list[tuple[Entry, torch.Tensor]], list[tuple[Entry, str]]]:
    """The ``optimizer_state`` measurements of ``param`` after ``optimizer``'s step (this rank's
    part of each), and the rows it cannot measure with why.

    ``grad_sq_over_v`` is ``g**2 / (v / (1 - beta2**t))`` in float64, with ``g`` the gradient
    the step used, ``v`` its ``exp_avg_sq`` and ``t`` its ``step``: far below 1 where the
    squared gradient fell far below the second moment (Bai et al. 2025). An entry whose
    ``v`` is zero (its gradient was zero at every step) is NaN (counted, not averaged)."""
    state = optimizer.state.get(param)
    if not state or "exp_avg" not in state or "exp_avg_sq" not in state:
        reason = NO_MOMENTS_REASON.format(optimizer=type(optimizer).__name__)
        return [], [(_state_entry(entry, part, None, stamp), reason) for part in STATE_PARTS]
    m, v = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
    found = [
        (_state_entry(entry, "exp_avg", m, stamp), m),
        (_state_entry(entry, "exp_avg_sq", v, stamp), v),
    ]
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    betas, step, grad = group.get("betas"), state.get("step"), param.grad
    if grad is None or betas is None or step is None:
        return found, [(_state_entry(entry, "grad_sq_over_v", None, stamp), NO_GRADIENT_REASON)]
    g = local_tensor(grad).to(torch.float64)
    correction = 1.0 - float(betas[1]) ** float(step)
    ratio = g * g / (v.to(torch.float64) / correction)
    found.append((_state_entry(entry, "grad_sq_over_v", ratio, stamp), ratio))
    return found, []


_CAPTURE: Final = stage_of("parameter_update", "capture")


def budget_reason(budget: int, needed: int, held: int) -> str:
    """Why a parameter's update was not measured: its copy would exceed the budget."""
    return (
        f"parameter update not measured: copying this parameter before the optimizer step needs "
        f"{needed} bytes, {held} are held already, over update_budget_bytes={budget}; raise "
        "inject_observer(update_budget_bytes=...) to measure it"
    )


def difference(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """``after - before`` in float64, a new tensor on their device. The difference of two
    float32 (or narrower) values is exact in float64; in their own dtype it would round wherever
    the step is not small against the value (a weight near zero)."""
    return after.to(torch.float64) - before.to(torch.float64)


def _step_code() -> CodeType | None:
    """The code object of the wrapper torch puts around every ``Optimizer.step`` (it runs the
    step hooks); one object shared by all optimizer classes."""
    try:
        wrapper = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None)
        return wrapper.__code__
    except (AttributeError, TypeError):  # pragma: no cover - depends on the torch build
        return None


_STEP_CODE: Final = _step_code()


def stepping_optimizer() -> torch.optim.Optimizer | None:
    """The optimizer whose ``step`` is running on this thread, if any: a forward run by a
    step's closure (``optimizer.step(closure)``: LBFGS, Lightning) belongs to that step."""
    if _STEP_CODE is None:  # pragma: no cover - depends on the torch build
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _STEP_CODE:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.optim.Optimizer):
                return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def optimizer_parameter_ids(optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """Ids of every parameter ``optimizer`` holds (all of its param groups)."""
    return frozenset(id(p) for group in optimizer.param_groups for p in group["params"])


OptimizerHook = Callable[[torch.optim.Optimizer, Any, Any], None]
"""What torch calls before / after every optimizer step: ``hook(optimizer, args, kwargs)``."""


class OptimizerHookHost(Protocol):
    """Installs and removes the global optimizer step hooks (the gate's
    :class:`~ti_core.gate.optimizer_hooks.OptimizerHooks`)."""

    def install_optimizer_hooks(self, pre: OptimizerHook, post: OptimizerHook) -> None:
        """Register ``pre`` and ``post`` for every optimizer's step (no-op when installed)."""
        ...

    def remove_optimizer_hooks(self) -> None:
        """Remove them (no-op when none are installed)."""
        ...


@dataclass(eq=False)
class UpdateWindow:
    """``parameter_update`` and ``optimizer_state`` of one sample: its parameters waiting for an
    optimizer step."""

    sample_id: int
    forward_index: int
    pending: dict[int, tuple[Entry, weakref.ref[torch.Tensor]]] = field(default_factory=dict)
    states: dict[int, tuple[Entry, weakref.ref[torch.Tensor]]] = field(default_factory=dict)
    """Parameters whose optimizer state is still to read."""
    state_gaps: list[tuple[Entry, str]] = field(default_factory=list)
    stepped: bool = False
    """An optimizer stepped since the window opened."""
    in_step: weakref.ref[torch.optim.Optimizer] | None = None
    """The optimizer whose step runs the sampled forward (a closure), if any."""
    in_step_ids: frozenset[int] = frozenset()
    gaps: list[tuple[Entry, str]] = field(default_factory=list)


@dataclass(eq=False)
class _Copy:
    """A parameter's value before the running step (its own dtype and device), for every
    window waiting for it."""

    param: weakref.ref[torch.Tensor]
    before: torch.Tensor
    windows: list[tuple[UpdateWindow, Entry]]


class OptimizerStepHook(HookObject):
    """Global optimizer step pre- or post-hook, installed while an update window is open."""

    __slots__ = ("post", "tracker")

    def __init__(self, tracker: UpdateTracker, *, post: bool) -> None:
        self.tracker = weakref.ref(tracker)
        self.post = post

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tracker = self.tracker()
        if tracker is None:
            return
        if self.post:
            tracker.post_step(optimizer)
        else:
            tracker.pre_step(optimizer)


class UpdateTracker:
    """Pairs each sampled forward with the first optimizer step that follows it.

    A parameter's update is measured at the first step, after the window opened, of an
    optimizer holding it; several optimizers each measure theirs. Copies of the values before
    a step are bounded by ``budget`` bytes at any time; beyond it, parameters get unavailable
    rows naming the budget.
    """

    def __init__(
        self,
        target: weakref.ref[SignalTarget],
        budget: int,
        *,
        updates: bool = True,
        states: bool = False,
    ) -> None:
        self._target = target
        self._budget = budget
        self._updates = updates
        self._states = states
        self._host: weakref.ref[OptimizerHookHost] | None = None
        self._lock = threading.RLock()
        self._windows: list[UpdateWindow] = []
        self._copies: dict[int, dict[int, _Copy]] = {}
        self._held = 0
        self._hooked = False
        self._closed = False
        self.waiting = False
        """Read by the gate at every root forward: close stepped windows there."""

    def bind(self, host: OptimizerHookHost) -> None:
        self._host = weakref.ref(host)

    # -- windows (training thread, during a sampled forward)

    def open(self, window: UpdateWindow) -> None:
        """Start waiting for the step that follows ``window``'s forward (or runs it)."""
        optimizer = stepping_optimizer()
        if optimizer is not None:
            window.in_step = weakref.ref(optimizer)
            window.in_step_ids = optimizer_parameter_ids(optimizer)
        with self._lock:
            if self._closed:
                return
            self._windows.append(window)
            if not self._hooked:
                host = None if self._host is None else self._host()
                if host is not None:
                    host.install_optimizer_hooks(
                        OptimizerStepHook(self, post=False), OptimizerStepHook(self, post=True)
                    )
                    self._hooked = True

    def add(self, window: UpdateWindow, key: int, entry: Entry, param: torch.Tensor) -> None:
        """Wait for ``param``'s update in ``window``; inside a step's closure, copy it now."""
        with self._lock:
            if self._states:
                window.states[key] = (entry, weakref.ref(param))
            if not self._updates:
                return
            window.pending[key] = (entry, weakref.ref(param))
            optimizer = None if window.in_step is None else window.in_step()
            if optimizer is not None and key in window.in_step_ids:
                self._copy(optimizer, window, key, entry, param)

    def _copy(
        self,
        optimizer: torch.optim.Optimizer,
        window: UpdateWindow,
        key: int,
        entry: Entry,
        param: torch.Tensor,
    ) -> None:
        copies = self._copies.setdefault(id(optimizer), {})
        found = copies.get(key)
        if found is not None:
            if all(w is not window for w, _ in found.windows):
                found.windows.append((window, entry))
            return
        value = local_tensor(param)
        needed = value.numel() * value.element_size()
        if self._held + needed > self._budget:
            window.pending.pop(key, None)
            window.gaps.append((entry, budget_reason(self._budget, needed, self._held)))
            return
        copies[key] = _Copy(weakref.ref(param), value.clone(), [(window, entry)])
        self._held += needed

    # -- optimizer steps (hooks torch calls)

    def pre_step(self, optimizer: torch.optim.Optimizer) -> None:
        target = self._target()
        if target is None:
            return
        try:
            with self._lock:
                if not self._windows or not self._updates:
                    return
                ids = optimizer_parameter_ids(optimizer)
                for window in self._windows:
                    for key, (entry, ref) in list(window.pending.items()):
                        param = ref()
                        if key in ids and param is not None:
                            self._copy(optimizer, window, key, entry, param)
        except Exception as error:
            target.errors.handle(_CAPTURE, error)

    def post_step(self, optimizer: torch.optim.Optimizer) -> None:
        target = self._target()
        if target is None:
            return
        ready: list[_Ready] = []
        try:
            with self._lock:
                if self._states:
                    ready += self._read_states(target, optimizer)
                copies = self._copies.pop(id(optimizer), {})
                batches: dict[int, TensorBatch] = {}
                stamp = now_us()
                # One parameter at a time: its copy goes before the next difference is made.
                for key in list(copies):
                    copy = copies.pop(key)
                    self._held -= copy.before.numel() * copy.before.element_size()
                    param = copy.param()
                    if param is None:
                        continue
                    delta = difference(local_tensor(param), copy.before)
                    del copy.before
                    for window, entry in copy.windows:
                        if window.pending.pop(key, None) is None:
                            continue
                        batch = batches.get(id(window))
                        if batch is None:
                            batch = batches[id(window)] = target.new_batch()
                        add_entry(batch, measured_entry(entry, delta, stamp), delta)
                for window in self._windows:
                    window.stepped = True
                    batch = batches.get(id(window))
                    if batch is not None or window.gaps:
                        ready.append(("parameter_update", window, batch, window.gaps))
                        window.gaps = []
                self._windows = [w for w in self._windows if w.pending or w.states]
                self.waiting = True  # hooks are removed at the next root forward, not in here
        except Exception as error:
            target.errors.handle(_CAPTURE, error)
        self._emit(target, ready)

    def _read_states(self, target: SignalTarget, optimizer: torch.optim.Optimizer) -> list[_Ready]:
        """The ``optimizer_state`` of every waiting parameter ``optimizer`` holds, read after
        its step: one signal per window."""
        ready: list[_Ready] = []
        ids = optimizer_parameter_ids(optimizer)
        stamp = now_us()
        for window in self._windows:
            batch: TensorBatch | None = None
            gaps: list[tuple[Entry, str]] = []
            for key, (entry, ref) in list(window.states.items()):
                param = ref()
                if param is None or key not in ids:
                    continue
                del window.states[key]
                found, missing = optimizer_state(optimizer, param, entry, stamp)
                gaps += missing
                for part_entry, tensor in found:
                    if batch is None:
                        batch = target.new_batch()
                    add_entry(batch, part_entry, tensor)
            if batch is not None or gaps:
                ready.append(("optimizer_state", window, batch, gaps))
        return ready

    def _emit(self, target: SignalTarget, ready: Sequence[_Ready]) -> None:
        for signal, window, batch, gaps in ready:
            if batch is None:
                batch = target.new_batch()
            target.emit(_ended(signal, window, batch, gaps))

    # -- closing windows

    def root_forward(self) -> None:
        """A root forward starts: a window whose step came and went gives up on the parameters
        no optimizer updated; when no window is left, the optimizer hooks go."""
        target = self._target()
        ready: list[_Ready] = []
        with self._lock:
            self.waiting = False
            keep = []
            for window in self._windows:
                if window.stepped:
                    ready += _gave_up(window, NO_OPTIMIZER_REASON, STATE_NO_OPTIMIZER_REASON)
                else:
                    keep.append(window)
            self._windows = keep
            if not keep:
                self._unhook()
        if target is not None and not target.closed:
            self._emit(target, ready)

    def _unhook(self) -> None:
        if self._hooked:
            host = None if self._host is None else self._host()
            if host is not None:
                host.remove_optimizer_hooks()
            self._hooked = False

    def close(self) -> list[EndedSignal]:
        """The observer is removed: no more windows; return the open ones' unavailable rows
        (for the observer to emit before it closes its sinks)."""
        target = self._target()
        with self._lock:
            self._closed = True
            left: list[EndedSignal] = []
            for window in self._windows:
                reasons = (
                    (NO_OPTIMIZER_REASON, STATE_NO_OPTIMIZER_REASON)
                    if window.stepped
                    else (REMOVED_REASON, STATE_REMOVED_REASON)
                )
                for signal, _, _, gaps in _gave_up(window, *reasons):
                    if target is not None:
                        left.append(_ended(signal, window, target.new_batch(), gaps))
            self._windows = []
            self._copies.clear()
            self._held = 0
            self.waiting = False
            self._hooked = False  # the gate removes the hooks themselves
        return left


_Ready = tuple[Signal, UpdateWindow, TensorBatch | None, Sequence[tuple[Entry, str]]]
"""A signal of a window ready to emit: its name, the window, its measurements, its gaps."""


def _gave_up(window: UpdateWindow, update_reason: str, state_reason: str) -> list[_Ready]:
    """The unavailable rows of a window closing with parameters still waiting (each signal
    that has any), its waits cleared."""
    ready: list[_Ready] = []
    gaps = [*window.gaps, *((e, update_reason) for e, _ in window.pending.values())]
    if gaps:
        ready.append(("parameter_update", window, None, gaps))
    states = [
        *window.state_gaps,
        *(
            (_state_entry(e, part, None, e.timestamp_us), state_reason)
            for e, _ in window.states.values()
            for part in STATE_PARTS
        ),
    ]
    if states:
        ready.append(("optimizer_state", window, None, states))
    window.pending.clear()
    window.states.clear()
    window.gaps, window.state_gaps = [], []
    return ready


def _ended(
    signal: Signal, window: UpdateWindow, batch: TensorBatch, gaps: Sequence[tuple[Entry, str]]
) -> EndedSignal:
    return EndedSignal(signal, window.sample_id, window.forward_index, batch, Gaps.of(gaps))


__all__ = [
    "DEFAULT_UPDATE_BUDGET_BYTES",
    "NO_GRADIENT_REASON",
    "NO_MOMENTS_REASON",
    "NO_OPTIMIZER_REASON",
    "REMOVED_REASON",
    "STATE_NO_OPTIMIZER_REASON",
    "STATE_PARTS",
    "STATE_REMOVED_REASON",
    "OptimizerHook",
    "OptimizerHookHost",
    "OptimizerStepHook",
    "UpdateTracker",
    "UpdateWindow",
    "budget_reason",
    "difference",
    "optimizer_parameter_ids",
    "optimizer_state",
    "state_path",
    "stepping_optimizer",
]
