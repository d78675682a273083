"""The sampling gate: which root forwards are captured, and the hooks that capture them.

One gate per observer. It is the :class:`~ti_core.capture.hooks.CaptureTarget` every forward
hook calls, and the one place that installs and removes hooks: it keeps the handle (or undo
function) of each, so removal can never miss one. With the parameter signals on, that includes
torch's global optimizer step hooks (installed only while a sampled forward waits for its
optimizer step) and, through :class:`~ti_core.capture.parameters.ParameterCapture`, the
post-accumulate-grad hooks of a sample's parameters.

State (:class:`GateState`, one value per gate, changed under its lock)::

    NEW ──attach──> IDLE ──sampled root forward starts──> CAPTURING
                     ^                                        │
                     └── unsampled root forward starts, ──────┘
                         no sample in flight on any thread
    IDLE / CAPTURING ──compiled (attach to an OptimizedModule; a call hook traced)──> COMPILED
    IDLE / CAPTURING / COMPILED ──a root hook traced──> COMPILED_AHEAD
    any but CLOSED ──close──> CLOSED (final)

- ``IDLE``: only the two root hooks exist; an unsampled root forward runs them and nothing else.
- ``CAPTURING``: per-module capture (``_call_impl`` overrides, forward hooks, or ``forward``
  overrides: :meth:`Gate._install_capture_locked`) is installed;
  samples may be in flight on several threads (:attr:`Gate.in_flight`).
- ``COMPILED``: the model runs under ``torch.compile`` (:mod:`ti_core.compiled`). Per-module
  capture stays installed until removal, because Dynamo guards on module hooks and changing
  them would recompile; each root forward's decision goes to the compiled graphs through the
  gate's trace flags (one cached graph per decision).
- ``COMPILED_AHEAD``: as ``COMPILED``, but the root's own hooks are traced into the graph, so
  no Python runs before it: the decision for each root forward is taken when the previous one
  ends (by the ``end`` / ``advance`` operators, or the eager root hook).
- ``CLOSED``: every hook removed; nothing is recorded again (late gradients are dropped).

Independently of the state, while an update window waits to be closed
(:attr:`ParameterCapture.waiting`), the next outermost root forward closes it first.

Per-thread state (nesting depth of root calls, the frame of the outermost one, this thread's
current :class:`~ti_core.capture.sample.Sample`) lives in a ``threading.local``: each thread's
forwards are sampled and recorded independently.
"""

from __future__ import annotations

import enum
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Final, Protocol

import torch
from torch import nn

from ti_core.capture.context import in_backward
from ti_core.capture.gradients import GradHook
from ti_core.capture.hooks import (
    CallHook,
    RootPostHook,
    RootPreHook,
    call_overridable,
    install_call_override,
    install_forward_override,
    install_root_forward_override,
    remove_call_overrides,
)
from ti_core.capture.parameters import ParameterCapture
from ti_core.capture.sample import Sample
from ti_core.capture.updates import OptimizerHook
from ti_core.compiled import operators
from ti_core.compiled.record import Sites, record_traced_call
from ti_core.errors import ErrorPolicy
from ti_core.sampling import Sampler
from ti_core.selection import compiled_wrappers


class GateState(enum.Enum):
    """Where an observer's capture stands; transitions in the module docstring."""

    NEW = "new"
    IDLE = "idle"
    CAPTURING = "capturing"
    COMPILED = "compiled"
    COMPILED_AHEAD = "compiled-ahead"
    CLOSED = "closed"


# Module-level aliases: the root hooks compare the state on every forward, and attribute access
# on an Enum class costs several times a global lookup.
_IDLE: Final = GateState.IDLE
_CAPTURING: Final = GateState.CAPTURING
_COMPILED: Final = GateState.COMPILED
_AHEAD: Final = GateState.COMPILED_AHEAD
_CLOSED: Final = GateState.CLOSED


class SampleOwner(Protocol):
    """What the gate hands samples to (the observer): it makes them and emits them."""

    def start_sample(self, sample_id: int, forward_index: int) -> Sample:
        """A new sample for the root forward ``forward_index`` (``sample_id``-th sampled)."""
        ...

    def end_forward(self, sample: Sample) -> None:
        """The sample's root forward returned (or raised): emit what it recorded."""
        ...


class _ThreadState(threading.local):
    depth = 0
    outer: FrameType | None = None
    sample: Sample | None = None


def _has_ancestor(frame: FrameType, target: FrameType | None) -> bool:
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class Gate:
    """Decides per root forward whether it is sampled, and owns every hook of one observer."""

    def __init__(
        self,
        *,
        modules: Sequence[nn.Module],
        root_layer: int | None,
        sampler: Sampler,
        errors: ErrorPolicy,
        capture_direct_forwards: bool,
        owner: SampleOwner,
        parameters: ParameterCapture | None = None,
        call_overrides: bool = True,
    ) -> None:
        self._modules = [weakref.ref(m) for m in modules]
        self._root_layer = root_layer
        self._sampler = sampler
        self._errors = errors
        self._direct = capture_direct_forwards
        # The owner holds the gate; the gate refers back weakly (no reference cycle).
        self._owner: weakref.ref[SampleOwner] = weakref.ref(owner)
        self._state = GateState.NEW
        self._lock = threading.Lock()
        self._local = _ThreadState()
        self._counter = itertools.count()
        self._latest = -1  # index of the latest root forward started, on any thread
        self._samples = 0
        self._in_flight = 0
        # Every hook this gate installed, as the function that removes it exactly.
        self._root_removers: list[Callable[[], None]] = []
        self._capture_removers: list[Callable[[], None]] = []
        self._call_overrides = call_overrides
        """Whether eager capture may use :class:`CallOverride` (not inside ``DataParallel``,
        whose replicas copy a module's ``__dict__``; turned off when a replica is met)."""
        self._overrides = False
        """Whether any installed capture is a :class:`CallOverride`."""
        # Compiled graphs (ti_core.compiled): the key traced hooks carry, the flags the graphs
        # read at trace time, the tensor paths they record, the decision taken ahead.
        self._trace_key, self._flags = operators.register(self, root_layer)
        self._sites = Sites()
        self._ahead: tuple[int, bool] | None = None
        # The parameter signals: their hooks, and torch's global optimizer step hooks (process
        # wide, so under their own lock; installed while an update window is open).
        self._parameters = parameters
        self._optimizer_lock = threading.Lock()
        self._optimizer_removers: list[Callable[[], None]] = []
        if parameters is not None:
            parameters.bind(self)

    # ------------------------------------------------------------------ observable state

    @property
    def state(self) -> GateState:
        return self._state

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (final)."""
        return self._state is _CLOSED

    @property
    def in_flight(self) -> int:
        """Sampled root forwards running now, on any thread."""
        return self._in_flight

    @property
    def current_sample(self) -> Sample | None:
        """The sample of the root forward running on this thread, if it is sampled."""
        return self._local.sample

    @property
    def latest_forward(self) -> int:
        """Index of the latest root forward that started (-1 before the first)."""
        return self._latest

    @property
    def depth(self) -> int:
        """Nesting depth of root forwards on this thread (0 outside any)."""
        return self._local.depth

    @property
    def trace_key(self) -> int:
        """The key under which compiled graphs reach this gate (:mod:`ti_core.compiled`)."""
        return self._trace_key

    # ------------------------------------------------------------------ hooks: install / remove

    def attach(self, root: nn.Module) -> None:
        """Install the two permanent root hooks (``NEW`` -> ``IDLE``, or ``COMPILED`` for a
        ``torch.compile``d root)."""
        with self._lock:
            if self._state is not GateState.NEW:
                raise RuntimeError(f"a gate attaches once; this one is {self._state.value}")
            self._root_removers = [
                root.register_forward_pre_hook(RootPreHook(self), prepend=True).remove,
                root.register_forward_hook(RootPostHook(self), always_call=True).remove,
            ]
            compiled = bool(compiled_wrappers(root))
            if self._direct and not compiled:  # a direct model.forward(x) is a root forward
                self._root_removers.append(install_root_forward_override(self, root))
            self._state = _IDLE
        if compiled:  # torch.compile's OptimizedModule: compiled from the start
            self.enter_compiled_mode(ahead=False)

    def close(self) -> None:
        """Remove every hook and override (-> ``CLOSED``); a no-op once closed."""
        with self._lock:
            if self._state is _CLOSED:
                return
            self._state = _CLOSED
            self._remove_capture_locked()
            removers, self._root_removers = self._root_removers, []
            for remove in removers:
                remove()
            operators.unregister(self._trace_key)
        self.remove_optimizer_hooks()
        if self._parameters is not None:
            self._parameters.close_hooks()

    def install_optimizer_hooks(self, pre: OptimizerHook, post: OptimizerHook) -> None:
        """Register ``pre`` / ``post`` as torch's global optimizer step pre- and post-hooks
        (every optimizer of the process runs them); a no-op when installed or closed."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        with self._optimizer_lock:
            if self._optimizer_removers or self._state is _CLOSED:
                return
            self._optimizer_removers = [
                register_optimizer_step_pre_hook(pre).remove,
                register_optimizer_step_post_hook(post).remove,
            ]

    def remove_optimizer_hooks(self) -> None:
        """Remove the global optimizer step hooks (never from inside one: torch is iterating
        them then)."""
        with self._optimizer_lock:
            removers, self._optimizer_removers = self._optimizer_removers, []
        for remove in removers:
            remove()

    @property
    def optimizer_hooks_installed(self) -> bool:
        """Whether this gate's global optimizer step hooks are registered now."""
        return bool(self._optimizer_removers)

    def _install_capture_locked(self, *, compiled: bool = False) -> None:
        """Per-module capture on every selected module but the root: a ``forward`` override
        with ``capture_direct_forwards``; else, eagerly, a :class:`CallOverride` wherever
        :func:`call_overridable` (torch keeps its fast call path) and a forward hook elsewhere;
        ``compiled``: forward hooks, which Dynamo traces."""
        overrides = self._call_overrides and not compiled and not self._direct
        try:
            for layer, ref in enumerate(self._modules):
                module = ref()
                if module is None or layer == self._root_layer:
                    continue
                if self._direct:
                    self._capture_removers.append(install_forward_override(self, layer, module))
                elif overrides and call_overridable(module):
                    self._capture_removers.append(install_call_override(self, layer, module))
                    self._overrides = True
                else:
                    handle = module.register_forward_hook(CallHook(self, layer))
                    self._capture_removers.append(handle.remove)
        except BaseException:
            self._remove_capture_locked()  # all or nothing
            raise
        self._state = _CAPTURING

    def _remove_capture_locked(self) -> None:
        removers, self._capture_removers = self._capture_removers, []
        self._overrides = False
        for remove in reversed(removers):
            remove()
        if self._state is _CAPTURING:
            self._state = _IDLE

    # ------------------------------------------------------------------ CaptureTarget

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
        if self._state is _CLOSED or in_backward():
            return
        if self._errors.has_deferred:
            self._errors.report_deferred()
        parameters = self._parameters
        if parameters is not None and parameters.waiting:
            try:
                parameters.root_forward()
            except Exception as error:
                self._errors.handle("parameter update capture", error)
        try:
            if self._state is _AHEAD:
                index, sampled = self._take_ahead()
            else:
                index = next(self._counter)
                sampled = bool(self._sampler.should_sample(index))
            self._latest = index
            self._flags.sampled = sampled  # what a compiled frame run next specializes on
            if not sampled:
                if self._state is _CAPTURING and not self._in_flight:
                    with self._lock:
                        if self._state is _CAPTURING and not self._in_flight:
                            self._remove_capture_locked()
                return
            self._start_sample(local, index)
        except Exception as error:
            self._errors.handle("sampling", error)

    def _start_sample(self, local: _ThreadState, index: int) -> None:
        """Start this thread's sample of the sampled root forward ``index``."""
        owner = self._owner()
        if owner is None:  # pragma: no cover - the owner holds this gate
            return
        with self._lock:
            # another thread may have closed the gate since the caller's check
            if self._state is _CLOSED:
                return
            if self._state is _IDLE:
                self._install_capture_locked()
            sample_id = self._samples
            self._samples += 1
            self._in_flight += 1
        try:
            local.sample = owner.start_sample(sample_id, index)
        except BaseException:
            with self._lock:
                self._in_flight -= 1
            raise

    def _abandon(self, local: _ThreadState) -> None:
        """Drop the state of an interrupted root forward of this thread."""
        local.depth = 0
        local.outer = None
        if local.sample is not None:
            local.sample = None
            with self._lock:
                self._in_flight -= 1

    def in_root_forward(self, caller: FrameType) -> bool:
        """Whether ``caller`` runs inside this thread's root forward (not one that an
        interrupt left behind: :meth:`root_enter` drops that one)."""
        local = self._local
        return bool(local.depth) and _has_ancestor(caller, local.outer)

    def replica_entered(self, root: nn.Module) -> None:
        """A ``DataParallel`` replica of the root starts a forward: its modules copied their
        originals' ``__dict__`` (a :class:`CallOverride` there would run the original) but share
        their hook dicts. Capture is by forward hooks from now on, these included."""
        remove_call_overrides(root)  # every replica's own copies, whichever comes first
        with self._lock:
            self._call_overrides = False
            state = self._state
            if self._overrides and state is not _CLOSED:
                self._remove_capture_locked()
                self._install_capture_locked(compiled=state is _COMPILED or state is _AHEAD)
                self._state = state

    def root_exit(self, module: nn.Module, output: Any) -> None:
        """Forward hook of the root (also runs when the forward raised): end the sample."""
        local = self._local
        if local.depth > 0:
            local.depth -= 1
        if not local.depth:
            local.outer = None
            if self._state is _AHEAD:
                self._decide_ahead()
        sample = local.sample
        if sample is None:
            return
        if self._root_layer is not None:
            self.capture(self._root_layer, module, output)
        if local.depth:
            return
        local.sample = None
        with self._lock:
            self._in_flight -= 1
        if self._state is _CLOSED:
            return
        owner = self._owner()
        if owner is None:  # pragma: no cover - the owner holds this gate
            return
        try:
            owner.end_forward(sample)
        except Exception as error:
            self._errors.handle("forward emission", error)

    def capture(self, layer: int, module: nn.Module, output: Any) -> None:
        """One call of a selected module during a sampled forward of this thread."""
        sample = self._local.sample
        if sample is None or in_backward():
            return
        try:
            sample.record(layer, module, output)
        except Exception as error:
            self._errors.handle("output capture", error)

    # ------------------------------------------------------------------ compiled graphs
    # The CompiledTarget of ti_core.compiled.operators: the traced hooks call the first two at
    # trace time, the operators in compiled graphs the others at run time.

    def enter_compiled_mode(self, *, ahead: bool) -> None:
        """The model runs compiled (``ahead``: with the root's hooks traced into the graph):
        keep per-module capture installed from now on (-> ``COMPILED`` / ``COMPILED_AHEAD``)."""
        with self._lock:
            state = self._state
            if state is _CLOSED or state is _AHEAD or (state is _COMPILED and not ahead):
                return
            if state is _IDLE:
                self._install_capture_locked(compiled=True)
            self._state = _AHEAD if ahead else _COMPILED
        if ahead:
            self._decide_ahead()  # the forward being traced now runs on this decision

    def intern_paths(self, paths: tuple[str, ...]) -> int:
        return self._sites.intern(paths)

    def _decide_ahead(self) -> None:
        """Decide the next root forward now, and tell the compiled graphs."""
        try:
            index = next(self._counter)
            sampled = bool(self._sampler.should_sample(index))
        except Exception as error:
            sampled = False
            self._errors.handle("sampling", error)
        self._ahead = (index, sampled)
        self._flags.sampled = sampled

    def _take_ahead(self) -> tuple[int, bool]:
        """This root forward's decision, taken ahead (or now, when another thread took it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            return ahead
        index = next(self._counter)
        return index, bool(self._sampler.should_sample(index))

    def compiled_begin(self) -> None:
        if self._state is _CLOSED or in_backward() or self._local.sample is not None:
            return
        if self._errors.has_deferred:
            self._errors.report_deferred()
        try:
            index, sampled = self._take_ahead()
            self._latest = index
            if sampled:
                self._start_sample(self._local, index)
        except Exception as error:
            self._errors.handle("sampling", error)

    def compiled_end(self) -> None:
        if in_backward():
            return
        local = self._local
        sample, local.sample = local.sample, None
        if sample is not None:
            with self._lock:
                self._in_flight -= 1
            owner = self._owner()
            if self._state is not _CLOSED and owner is not None:
                try:
                    owner.end_forward(sample)
                except Exception as error:
                    self._errors.handle("forward emission", error)
        if self._state is not _CLOSED:
            self._decide_ahead()

    def compiled_advance(self) -> None:
        if self._state is _CLOSED or in_backward():
            return
        if self._ahead is None:
            next(self._counter)  # another thread took this forward's decision: count it
        self._ahead = None
        self._decide_ahead()

    def compiled_record(
        self,
        tensors: list[torch.Tensor],
        layer: int,
        site: int,
        train: bool,
        grad_enabled: bool,
        kinds: list[int],
    ) -> list[GradHook | None] | None:
        sample = self._local.sample
        if sample is None or in_backward():
            return None
        try:
            paths = self._sites.paths(site)
            return record_traced_call(sample, layer, paths, tensors, train, grad_enabled, kinds)
        except Exception as error:
            self._errors.handle("output capture", error)
            return None


__all__ = ["Gate", "GateState", "SampleOwner"]
