"""The sampling gate: which root forwards are captured, and the hooks that capture them.

One gate per observer. It is the :class:`~ti_core.capture.hooks.CaptureTarget` every forward
hook calls, and the one owner of every hook: the module hooks and overrides
(:mod:`ti_core.gate.hook_installation`, which keeps the exact remover of each, so removal can never
miss one), and with the parameter signals on torch's global optimizer step hooks
(:mod:`ti_core.gate.optimizer_hooks`, installed only while a sampled forward waits for its
optimizer step) and, through :class:`~ti_core.capture.parameters.ParameterCapture`, the
post-accumulate-grad hooks of a sample's parameters. Its side of the protocol with compiled
graphs is :mod:`ti_core.gate.compiled`.

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
  overrides: :class:`~ti_core.gate.hook_installation.HookInstallation`) is installed;
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
current :class:`~ti_core.capture.sample.Sample`) lives in a ``threading.local``
(:mod:`ti_core.gate.root_nesting`): each thread's forwards are sampled and recorded independently.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any, Final, Protocol

from torch import nn

from ti_core.call_context import in_backward
from ti_core.call_signals import CallSignal
from ti_core.capture.parameters import ParameterCapture
from ti_core.capture.sample import Sample
from ti_core.compiled import operators
from ti_core.compiled.sites import Sites
from ti_core.cost import CostMeter
from ti_core.errors import ErrorPolicy
from ti_core.gate.compiled import CompiledGate
from ti_core.gate.hook_installation import HookInstallation
from ti_core.gate.optimizer_hooks import OptimizerHooks
from ti_core.gate.root_nesting import ScopedRoots, ThreadRoots, has_ancestor
from ti_core.sampling import Sampler
from ti_core.selection import compiled_wrappers
from ti_core.sentinel.recorder import SENTINEL_STAGE, FlightRecorder
from ti_core.stages import SAMPLING, stage_of


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

_OUTPUT_CAPTURE: Final = stage_of("output", "capture")
_UPDATE_CAPTURE: Final = stage_of("parameter_update", "capture")


class SampleOwner(Protocol):
    """What makes the gate's samples (the observer); a sample hands its own signals over when
    it ends (:meth:`~ti_core.capture.sample.Sample.end`)."""

    def start_sample(self, sample_id: int, forward_index: int) -> Sample:
        """A new sample for the root forward ``forward_index`` (``sample_id``-th sampled)."""
        ...


class Gate(CompiledGate):
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
        sentinel: FlightRecorder | None = None,
        meter: CostMeter | None = None,
        call_signals: tuple[CallSignal, ...] = (),
    ) -> None:
        self._root_layer = root_layer
        self._starts = bool(call_signals)
        """Whether a call signal (``input``) is recorded: each selected call is handed over as
        it starts, too (:meth:`capture_start`)."""
        self._sampler = sampler
        self._errors = errors
        # The owner holds the gate; the gate refers back weakly (no reference cycle).
        self._owner: weakref.ref[SampleOwner] = weakref.ref(owner)
        self._state = GateState.NEW
        self._lock = threading.Lock()
        self._local = ThreadRoots()
        self._counter = itertools.count()
        self._latest = -1  # index of the latest root forward started, on any thread
        self._samples = 0
        self._in_flight = 0
        self._hooks = HookInstallation(
            modules,
            root_layer,
            direct=capture_direct_forwards,
            call_overrides=call_overrides,
            starts=self._starts,
        )
        """Every module hook and override (changed under the lock)."""
        # Compiled graphs (ti_core.compiled): the key traced hooks carry, the flags the graphs
        # read at trace time, the tensor paths they record, the decision taken ahead.
        self._trace_key, self._flags = operators.register(self, root_layer)
        self._flags.call_signals = call_signals
        self._sites = Sites()
        self._ahead: tuple[int, bool] | None = None
        # The parameter signals: their hooks, and torch's global optimizer step hooks.
        self._parameters = parameters
        self._optimizer_hooks = OptimizerHooks()
        if parameters is not None:
            parameters.bind(self._optimizer_hooks)
        # The flight recorder's checks (None: the sentinel is off). In its dense mode they run
        # on every selected module of every root forward, so per-module capture stays
        # installed from attach to close; in replay mode only the root hooks check.
        self._sentinel = sentinel
        options = None if sentinel is None else sentinel.options
        self._dense = options is not None and not options.replays
        self._set_dense_checks(self._dense)
        # The run's step times (ti_core.cost): one clock read per outermost root forward,
        # after its decision (and, unsampled, after capture is removed) so that the work a
        # sample leaves for the next forward falls in the sampled step.
        self._meter = meter
        self._clock = meter.clock if meter is not None else time.perf_counter

    # ------------------------------------------------------------------ observable state

    def _set_dense_checks(self, dense: bool) -> None:
        """Whether the sentinel checks every selected module (its dense mode, or a replay-mode
        root whose hooks are traced into compiled graphs) or only at the root."""
        sentinel = self._sentinel
        self._dense = dense
        self._flags.sentinel = dense
        self._flags.slots = None if sentinel is None else sentinel.slots
        self._flags.gradient_slots = None if sentinel is None else sentinel.gradient_slots
        self._flags.gradient_checks = dense and sentinel is not None and sentinel.checks_gradients

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

    def current_index(self) -> int:
        """Index of the root forward running now or last started (its decision taken ahead
        under ``COMPILED_AHEAD``); -1 before the first."""
        ahead = self._ahead
        if self._state is _AHEAD and ahead is not None:
            return ahead[0]
        return self._latest

    @property
    def trace_key(self) -> int:
        """The key under which compiled graphs reach this gate (:mod:`ti_core.compiled`)."""
        return self._trace_key

    # ------------------------------------------------------------------ state transitions

    def attach(self, root: nn.Module) -> None:
        """Install the two permanent root hooks (``NEW`` -> ``IDLE``, or ``COMPILED`` for a
        ``torch.compile``d root)."""
        with self._lock:
            if self._state is not GateState.NEW:
                raise RuntimeError(f"a gate attaches once; this one is {self._state.value}")
            compiled = bool(compiled_wrappers(root))
            self._hooks.install_root(self, root, compiled=compiled)
            self._state = _IDLE
            if self._dense and not compiled:
                self._install_capture_locked()
        if compiled:  # torch.compile's OptimizedModule: compiled from the start
            self.enter_compiled_mode(ahead=False)

    def close(self) -> None:
        """Remove every hook and override (-> ``CLOSED``); a no-op once closed."""
        with self._lock:
            if self._state is _CLOSED:
                return
            self._state = _CLOSED
            self._hooks.remove_capture()
            self._hooks.remove_root()
            operators.unregister(self._trace_key)
        self._optimizer_hooks.close()
        if self._parameters is not None:
            self._parameters.close_hooks()

    def _install_capture_locked(self, *, compiled: bool = False) -> None:
        """Per-module capture (-> ``CAPTURING``; the compiled states set their own)."""
        self._hooks.install_capture(self, compiled=compiled)
        self._state = _CAPTURING

    def _remove_capture_locked(self) -> None:
        """Per-module capture off (-> ``IDLE``); kept while the sentinel checks every forward,
        except at close and to reinstall it (``replica_entered``)."""
        self._hooks.remove_capture()
        if self._state is _CAPTURING:
            self._state = _IDLE

    def enter_compiled_mode(self, *, ahead: bool) -> None:
        """The model runs compiled (``ahead``: with the root's hooks traced into the graph):
        keep per-module capture installed from now on (-> ``COMPILED`` / ``COMPILED_AHEAD``).
        Called at trace time by the traced hooks (:mod:`ti_core.compiled.traced`)."""
        with self._lock:
            state = self._state
            if state is _CLOSED or state is _AHEAD or (state is _COMPILED and not ahead):
                return
            if state is _IDLE:
                self._install_capture_locked(compiled=True)
            self._state = _AHEAD if ahead else _COMPILED
            if ahead and self._sentinel is not None and not self._dense:
                # No Python runs at the root of such a graph: replay mode keeps no arguments
                # there and checks every selected module in the graph instead.
                self._set_dense_checks(True)
        if ahead:
            self.decide_ahead()  # the forward being traced now runs on this decision

    def replica_entered(self, root: nn.Module) -> None:
        """A ``DataParallel`` replica of the root starts a forward: capture is by forward hooks
        from now on (:meth:`HookInstallation.stop_call_overrides`), these included."""
        with self._lock:
            state = self._state
            if self._hooks.stop_call_overrides(root) and state is not _CLOSED:
                self._remove_capture_locked()
                self._install_capture_locked(compiled=state is _COMPILED or state is _AHEAD)
                self._state = state

    # ------------------------------------------------------------------ CaptureTarget

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """While the flight recorder replays a step on this thread: the root's and the
        modules' hooks do nothing (nothing is counted, sampled or checked)."""
        local = self._local
        before = local.paused
        local.paused = True
        try:
            yield
        finally:
            local.paused = before

    def scope(self) -> None:
        """From now on record only root forwards inside :meth:`within` (before the first
        root forward: ``inject_stage_observer``); every other one is not counted, sampled or
        checked."""
        if self._latest >= 0:
            raise RuntimeError("an observer is scoped before its first root forward")
        self._local = ScopedRoots()

    @contextmanager
    def within(self) -> Iterator[None]:
        """While a scoped observer's recorded forward runs on this thread (a pipeline stage's
        microbatch): its hooks work as unscoped."""
        local = self._local
        before = local.paused
        local.paused = False
        try:
            yield
        finally:
            local.paused = before

    def root_enter(
        self,
        caller: FrameType | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        module: nn.Module | None = None,
    ) -> None:
        """Forward pre-hook of the root: decide whether this root forward is sampled.

        ``caller`` is the frame that runs the root's hooks; it tells a genuinely nested root call
        from state left behind by a root forward that a BaseException (KeyboardInterrupt)
        interrupted, which skips the always-called forward hook. ``args`` and ``kwargs``: the
        forward's arguments (the flight recorder's replay mode keeps them; a selected root's
        call signals read them); ``module``: the root.
        """
        local = self._local
        if local.paused:
            return
        depth = local.depth
        if depth and caller is not None and not has_ancestor(caller, local.outer):
            self._abandon(local)
            depth = 0
        local.depth = depth + 1
        if depth:
            if self._starts and local.sample is not None and module is not None:
                self._nested_root_start(module, args, kwargs or {})
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
                self._errors.handle(_UPDATE_CAPTURE, error)
        try:
            if self._state is _AHEAD:
                index, sampled = self.take_ahead()
            else:
                index = next(self._counter)
                sampled = bool(self._sampler.should_sample(index))
            self._latest = index
            self._flags.sampled = sampled  # what a compiled frame run next specializes on
            if self._sentinel is not None:
                self._sentinel.begin(index, args, kwargs)
            meter = self._meter
            if not sampled:
                if self._state is _CAPTURING and not self._in_flight and not self._dense:
                    with self._lock:
                        if self._state is _CAPTURING and not self._in_flight:
                            self._remove_capture_locked()
                if meter is not None:
                    meter.forward(self._clock(), False)
                return
            if meter is not None:
                meter.forward(self._clock(), True)
            self._start_sample(local, index)
        except Exception as error:
            self._errors.handle(SAMPLING, error)
            return
        if self._starts and self._root_layer is not None and module is not None:
            self.capture_start(self._root_layer, module, args, kwargs or {})

    def _start_sample(self, local: ThreadRoots, index: int) -> None:
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

    def _end_sample(self, sample: Sample) -> None:
        """The root forward of ``sample`` ended (off this thread's state already): it hands
        its signals over, unless the gate closed meanwhile."""
        with self._lock:
            self._in_flight -= 1
        if self._state is not _CLOSED:
            sample.end()

    def _abandon(self, local: ThreadRoots) -> None:
        """Drop the state of an interrupted root forward of this thread."""
        if local.reset() is not None:
            with self._lock:
                self._in_flight -= 1

    def in_root_forward(self, caller: FrameType) -> bool:
        """Whether ``caller`` runs inside this thread's root forward (not one that an
        interrupt left behind: :meth:`root_enter` drops that one)."""
        return self._local.inside(caller)

    def root_exit(self, module: nn.Module, output: Any) -> None:
        """Forward hook of the root (also runs when the forward raised): end the sample."""
        local = self._local
        if local.paused:
            return
        if local.depth > 0:
            local.depth -= 1
        if not local.depth:
            local.outer = None
            if self._sentinel is not None:
                self._sentinel_end(module, output)
            if self._state is _AHEAD:
                self.decide_ahead()
        sample = local.sample
        if sample is None:
            return
        if self._root_layer is not None:
            self._record(self._root_layer, module, output)
        if local.depth:
            return
        local.sample = None
        self._end_sample(sample)

    def capture(self, layer: int, module: nn.Module, output: Any) -> None:
        """One call of a selected module: checked by the sentinel in its dense mode, recorded
        when this thread's root forward is sampled."""
        if not self._dense:
            if not self._local.paused:
                self._record(layer, module, output)
            return
        sentinel = self._sentinel
        assert sentinel is not None  # (dense checks need one)
        if in_backward() or self._local.paused:  # a recomputation (activation
            return  # checkpointing), not a forward; or the recorder's replay
        try:
            sentinel.check(layer, output)
        except Exception as error:
            self._errors.handle(SENTINEL_STAGE, error)
        if self._local.sample is not None:
            self._record(layer, module, output)

    def _nested_root_start(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """The root is called inside its own sampled forward: a call of the root layer (its
        output is recorded at each exit), when the root is selected."""
        if self._root_layer is not None:
            self.capture_start(self._root_layer, module, args, kwargs)

    def abandon_start(self, layer: int) -> None:
        """A call of ``layer`` whose start was recorded raised: its call-signal entries are
        dropped."""
        sample = self._local.sample
        if sample is not None and not self._local.paused:
            sample.abandon_start(layer)

    def capture_start(
        self, layer: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A call of a selected module starts: its call signals are recorded when this
        thread's root forward is sampled (installed only when one is on). Failures go to the
        error policy as each signal's capture (:meth:`Sample.record_start`)."""
        if self._local.paused:
            return
        sample = self._local.sample
        if sample is None or in_backward():
            return
        sample.record_start(layer, module, args, kwargs)

    def _record(self, layer: int, module: nn.Module, output: Any) -> None:
        sample = self._local.sample
        if sample is None or in_backward():
            return
        try:
            sample.record(layer, module, output)
        except Exception as error:
            self._errors.handle(_OUTPUT_CAPTURE, error)

    def _sentinel_end(self, module: nn.Module, output: Any) -> None:
        """The outermost root forward of this thread ended: the sentinel checks the root's
        own output (when selected) and reads the forward's flags."""
        sentinel = self._sentinel
        if sentinel is None or self._state is _CLOSED or in_backward():
            return
        try:
            if not self._dense:
                sentinel.end_root(output)
                return
            if self._root_layer is not None:
                sentinel.check(self._root_layer, output, last=True)
            sentinel.end()
        except Exception as error:
            self._errors.handle(SENTINEL_STAGE, error)


__all__ = ["Gate", "GateState", "SampleOwner"]
