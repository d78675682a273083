"""The observer: one per observed model, wiring the gate, capture and emission together.

Lifecycle: built and attached by ``inject_observer`` (sinks already open), detached by
``remove_observer``, which closes, in this order, the gate (every hook and override removed),
the flight recorder (its flag reads in flight acted on), the parameter update windows still
open (their unavailable rows emitted), the emitter (every queued signal written), hands the
run's measured telemetry cost to the sinks (:mod:`ti_core.cost`) and closes the sinks (each
closed once). In between, the
gate (:mod:`ti_core.gate`) decides which root forwards are sampled and calls back here to start
samples; capture hands each ended signal (a sample's outputs, the gradients one backward
delivered to it, ...: :class:`~ti_core.reduction.ended.EndedSignal`) to :meth:`Observer.emit`,
which gives it to the emitter (:mod:`ti_core.emission`). ``observer_of(model)`` returns it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Final

from torch import nn

from ti_core.capture.gradients import GradientTarget, LeafHooks
from ti_core.capture.parameters import ParameterCapture
from ti_core.capture.sample import Sample
from ti_core.capture.signals import call_signals
from ti_core.capture.updates import DEFAULT_UPDATE_BUDGET_BYTES
from ti_core.cost import CostMeter
from ti_core.emission.emitters import BackgroundEmitter, Emitter, InlineEmitter
from ti_core.emission.records import RunColumns
from ti_core.emission.sinks import SinkFanout
from ti_core.emission.writer import SignalWriter
from ti_core.errors import ErrorPolicy
from ti_core.gate import Gate, GateState
from ti_core.reduction.batch import StructureMemo, TensorBatch
from ti_core.reduction.ended import EndedSignal, SignalTarget
from ti_core.reduction.placement import SNAPSHOT_BUDGET_BYTES
from ti_core.reduction.plan import ReductionPlan
from ti_core.reduction.snapshots import SnapshotPool
from ti_core.sampling import Sampler
from ti_core.selection import unwrap_model
from ti_core.sentinel import DenseSampler, FlightRecorder, Sentinel
from ti_core.sentinel.replay import Replayer
from ti_core.sentinel.replay_context import reduced_across_ranks
from ti_core.sink import RunInfo, Sink, SinkCapabilities
from ti_schema import DEFAULT_SIGNALS, PARAMETER_SIGNALS, events_schema

_COST: Final = "telemetry cost measurement"


class Observer:
    """Capture and emission of one ``inject_observer`` call."""

    def __init__(
        self,
        *,
        root: nn.Module,
        modules: Sequence[nn.Module],
        focus: Sequence[int],
        run: RunInfo,
        sinks: Sequence[Sink],
        capabilities: Sequence[SinkCapabilities],
        sampler: Sampler,
        plan: ReductionPlan,
        errors: ErrorPolicy,
        capture_direct_forwards: bool,
        columns: RunColumns,
        background: bool = False,
        signals: Collection[str] = DEFAULT_SIGNALS,
        update_budget_bytes: int = DEFAULT_UPDATE_BUDGET_BYTES,
        sentinel: Sentinel | None = None,
        meter: CostMeter | None = None,
    ) -> None:
        self.run = run
        self.signals = frozenset(signals)
        """The signals this observer records (``inject_observer(signals=)``)."""
        self._attention_layers: dict[int, int] | None = (
            {id(m): i for i, m in enumerate(modules)} if "attention" in self.signals else None
        )
        """id of each selected module -> its layer, when the attention signal is on."""
        self._call_signals = call_signals(self.signals)
        """The call signals recorded (``input``: :mod:`ti_core.capture.signals`)."""
        self._errors = errors
        self._leaf_hooks = LeafHooks()
        self._plan = plan
        self._focus = frozenset(focus)
        self._pool = SnapshotPool()
        self._memo = StructureMemo()
        self.sinks = SinkFanout(sinks, capabilities, errors)
        """Every sink of the run: all writes, and the one close of each."""
        self.meter = meter if meter is not None else CostMeter()
        """The run's step times and telemetry cost (:mod:`ti_core.cost`; started at attach).
        ``inject_observer`` creates it and binds it to a sampler that reads it;
        the emission worker tells it when it works."""
        writer = SignalWriter(columns, self.sinks, errors)
        self._emitter: Emitter = (
            BackgroundEmitter(
                writer,
                errors,
                name=f"ti-core emission {run.run_id}",
                max_bytes=SNAPSHOT_BUDGET_BYTES,
                activity=self.meter,
            )
            if background
            else InlineEmitter(writer)
        )
        self._self_ref: weakref.ref[GradientTarget] = weakref.ref(self)
        self.parameters: ParameterCapture | None = None
        """The parameter signals' catalog, update tracker and hooks (None when they are off)."""
        if self.signals & {*PARAMETER_SIGNALS, "optimizer_state"}:
            target: weakref.ref[SignalTarget] = weakref.ref(self)
            self.parameters = ParameterCapture(
                modules, tuple(self.signals), target, update_budget_bytes
            )
        dense = DenseSampler(sampler)
        self.recorder = FlightRecorder(
            sentinel,
            dense,
            layer_names=columns.layer_names,
            module_types=columns.module_types,
            run_id=run.run_id,
            rank=run.rank,
            schema=events_schema(run.producer),
            write=self.sinks.write_events,
            errors=errors,
        )
        """The flight recorder: the sentinel's state, the run's events, dense captures."""
        self.gate = Gate(
            modules=modules,
            root_layer=next((i for i, m in enumerate(modules) if m is root), None),
            sampler=dense,
            errors=errors,
            capture_direct_forwards=capture_direct_forwards,
            owner=self,
            parameters=self.parameters,
            call_overrides=not any(isinstance(m, nn.DataParallel) for m in root.modules()),
            call_signals=self._call_signals,
            sentinel=self.recorder if sentinel is not None else None,
            meter=self.meter,
        )
        """Sampling decisions and every hook of this observer."""
        self.recorder.bind_latest(self.gate.current_index)
        self._replayer: Replayer | None = None
        if sentinel is not None and sentinel.replays:
            replayer = Replayer(
                unwrap_model(root),
                modules,
                columns.layer_names,
                rank=run.rank,
                reduced=_reduced(weakref.ref(root)),
                bypass=self.gate.replaying,
            )
            self.recorder.bind_replayer(replayer, type(root).__name__)
            self._replayer = replayer

    def as_pipeline_stage(self, stage: int, stages: int) -> None:
        """The observed model is stage ``stage`` of ``stages`` of a pipeline (before its first
        forward; ``ti_core.inject_stage_observer``): only the forwards inside
        :meth:`~ti_core.gate.Gate.within` are recorded, and a replay tells a gradient that
        arrived non-finite from the next stage."""
        self.gate.scope()
        if self._replayer is not None and stage < stages - 1:
            self._replayer.next_stage = stage + 1

    # Copies of a model (deepcopy, pickle, torch.save) carry no observer: this becomes None.
    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        return (type(None), ())

    def __repr__(self) -> str:
        return (
            f"<ti_core Observer run_id={self.run.run_id} layers={len(self.run.layers)} "
            f"sampler={self.run.sampler} state={self.gate.state.value}>"
        )

    @property
    def errors(self) -> ErrorPolicy:
        """The run's error policy."""
        return self._errors

    @property
    def state(self) -> GateState:
        """Where capture stands (see :class:`ti_core.gate.GateState`)."""
        return self.gate.state

    @property
    def closed(self) -> bool:
        """True once removed: nothing is recorded or written any more."""
        return self.gate.closed

    @property
    def emission_thread(self) -> threading.Thread | None:
        """The thread reducing and writing sampled signals (None: inline, or idle/not started)."""
        return self._emitter.thread

    # ------------------------------------------------------------------ attach / detach

    def attach(self, root: nn.Module) -> None:
        """Install the root hooks; give sinks that serve reads the emitter's barrier; the
        run's wall time starts."""
        self.meter.start()
        self.gate.attach(root)
        barrier = self._emitter.barrier()
        if barrier is not None:
            self.sinks.offer_barrier(barrier)

    def drain(self) -> None:
        """Wait until every signal that ended so far is reduced and written to the sinks, and
        report the failures that happened meanwhile (on this thread)."""
        self._emitter.drain()
        if self._errors.has_deferred:
            self._errors.report_deferred()

    def detach(self) -> list[tuple[Sink, Exception]]:
        """Remove every hook and override, write what is queued, close every sink once;
        return the close failures (for the caller to report once the model is clean)."""
        stopped_at = self.meter.clock()  # the run's wall time ends here: removal is not in it
        self.gate.close()
        self.recorder.close()
        self._leaf_hooks.close()
        if self.parameters is not None:
            for ended in self.parameters.flush():
                self._emitter.emit(ended)
        self._emitter.close()  # writes every queued signal first: nothing measured is lost
        if self._errors.has_deferred:
            self._errors.report_deferred()
        self.report_cost(now=stopped_at)
        return self.sinks.close()

    def report_cost(self, *, now: float | None = None, exiting: bool = False) -> None:
        """Hand the run's telemetry cost until ``now`` (the meter's clock; default: now) to
        the sinks that declared ``write_cost`` (``exiting``: from the end-of-process flush,
        without the fan-out's lock)."""
        if not self.sinks.want_cost:
            return
        try:
            cost = self.meter.cost(now)
        except Exception as error:
            self._errors.handle(_COST, error)
            return
        self.sinks.write_cost(cost, exiting=exiting)

    # ------------------------------------------------------------------ SampleOwner (the gate)

    def start_sample(self, sample_id: int, forward_index: int) -> Sample:
        if self.sinks.want_cost and self.meter.report_due():
            self.report_cost()  # a run killed without removal keeps a recent figure
        parameters = None
        if self.parameters is not None:
            parameters = self.parameters.start(sample_id, forward_index)
        return Sample(
            sample_id,
            forward_index,
            self.new_batch(),
            self._self_ref,
            signals=self.signals,
            parameters=parameters,
            attention=self._attention_layers,
            call_signals=self._call_signals,
        )

    # ------------------------------------------------------------------ SignalTarget (capture)

    def new_batch(self) -> TensorBatch:
        return TensorBatch(self._plan, self._focus, pool=self._pool, memo=self._memo)

    def emit(self, ended: EndedSignal) -> None:
        """A signal of a sample ended (its root forward returned, a backward or an optimizer
        step that reached it ended): write or queue it."""
        try:
            self._emitter.emit(ended)
        except Exception as error:
            self._errors.handle(ended.stage, error)

    @property
    def leaf_hooks(self) -> LeafHooks:
        return self._leaf_hooks

    def forward_started_since(self, forward_index: int) -> bool:
        return self.gate.latest_forward > forward_index


def _reduced(root: weakref.ref[nn.Module]) -> Callable[[], bool]:
    """Whether the root's gradients are reduced across ranks, asked at replay time (held
    weakly: the model holds its observer)."""

    def reduced() -> bool:
        module = root()
        return module is not None and reduced_across_ranks(module)

    return reduced


__all__ = ["Observer"]
