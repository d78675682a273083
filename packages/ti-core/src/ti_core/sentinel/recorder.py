"""The flight recorder of one observer: the sentinel's checks, the events, the dense captures.

Ownership: the observer builds one :class:`FlightRecorder` and closes it at removal.

Replay mode (the default): the gate calls :meth:`FlightRecorder.begin` (which keeps the
forward's arguments and RNG states, :class:`~ti_core.sentinel.replay.StepRecord`) and
:meth:`~FlightRecorder.end_root` (which checks the root's output tensors and hooks their
backward nodes, :mod:`~ti_core.sentinel.root_checks`) around every root forward; when a
backward through the root's output ends, :meth:`~FlightRecorder.backward_ended` checks the
selected modules' parameter gradients (and the root's inputs'). Plain CPU tensors are read at
once (:func:`~ti_core.sentinel.flags.check_all`); on an accelerator the flags are read
asynchronously, a backward's at the next optimizer step's start at the latest. An event
replays the step (:class:`~ti_core.sentinel.replay.Replayer`) before it is recorded, and
carries its verdict. A root whose hooks are traced into a compiled graph has no Python at its
root: it is checked as in the dense mode, and its events are not replayable.

Dense mode: the gate calls :meth:`FlightRecorder.begin`, :meth:`~FlightRecorder.check` and
:meth:`~FlightRecorder.end` around and inside every root forward (the compiled graphs hand it
their values, :meth:`~FlightRecorder.check_values`); gradients are checked by hooks on the
outputs' backward nodes (:mod:`~ti_core.sentinel.forwards`). Compiled graphs write their flags
into slots (:mod:`~ti_core.compiled.slots`), read with the root forward's other flags.

Events (``ti.events`` rows) go to the sinks that declare ``write_events`` at once, on the
thread that found them. State, changed under the recorder's lock::

    ARMED ──a check fires──> FIRED (one event, a dense capture triggered)
      ^                        │
      └── a later root forward whose output check and gradient check were both clean

so a run that stays non-finite records one event, not one per forward. "Later": its index
is above the event's, since checks can complete out of forward order (two forwards, then
one backward: the first forward's clean gradient check ends after the second's event). A
forward whose autograd graph is gone without a backward through it (inference with
gradients enabled) will never have a gradient check: once its graph is freed, its clean
outputs are enough.

Manual and loss triggers (:meth:`FlightRecorder.trigger`) record their event whatever the
state.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final, Unpack

import pyarrow as pa
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from ti_core.call_context import now_us
from ti_core.compiled.slots import FlagSlots, Keyed, PendingSlots, merge
from ti_core.errors import ErrorPolicy
from ti_core.sentinel.dense import DenseSampler
from ti_core.sentinel.events import Event, EventDetails, event_batch
from ti_core.sentinel.flags import Flagged, Flags, PendingRead, check_all
from ti_core.sentinel.forwards import (
    SENTINEL_STAGE,
    TRACED_ROOT,
    Forward,
    GradientCheck,
    GradientFlush,
    Watch,
    slot_check,
)
from ti_core.sentinel.options import DEFAULT_DENSE_FORWARDS, Sentinel
from ti_core.sentinel.replay import ROOT, Replayer, StepRecord, Verdict
from ti_core.sentinel.root_checks import RootGradient
from ti_core.tensor_paths import tensor_leaves
from ti_schema import EventKind

_RECENT: Final = 64
"""Root forwards whose clean output check waits for their gradient check (older ones are
forgotten: their backward never came)."""


class FlightRecorder:
    """Checks, events and dense captures of one observer."""

    def __init__(
        self,
        options: Sentinel | None,
        dense: DenseSampler,
        *,
        layer_names: Sequence[str],
        module_types: Sequence[str],
        run_id: str,
        rank: int,
        schema: pa.Schema,
        write: Callable[[pa.RecordBatch], None],
        errors: ErrorPolicy,
    ) -> None:
        self.options = options
        """The sentinel's options; None: no checks (manual and loss triggers still work)."""
        self.dense = dense
        self._names = tuple(layer_names)
        self._types = tuple(module_types)
        self._run_id = run_id
        self._rank = rank
        self._schema = schema
        self._write = write
        self._errors = errors
        self._lock = threading.Lock()
        self._local = threading.local()
        self._ids = itertools.count()
        self._armed = True
        self._fired_at = -1
        """The forward index of the latest ``nonfinite`` event: only a clean forward after it
        re-arms."""
        self._closed = False
        self._clean_outputs: dict[int, Watch | None] = {}
        """Root forwards whose output check was clean, waiting for their gradient check (with
        their eager gradient checks' ``Watch``; None: a compiled graph's checks)."""
        self._pending: list[tuple[Callable[[], bool] | None, Callable[[], None]]] = []
        """Reads asked for on an accelerator: ``(ready, act)``; ``ready`` None: act at the next
        root forward's end whatever (an output read, one forward later)."""
        self.slots = FlagSlots()
        """The slots compiled graphs (and, once there is one, the eager checks) write."""
        self.gradient_slots = FlagSlots()
        """The gradient slots inductor's backward graphs (and, once there is one, the eager
        gradient checks) write; read when the next root forward ends."""
        self._last: Forward | None = None
        """The latest root forward that ended (compiled gradient checks belong to it)."""
        self._latest: Callable[[], int] = lambda: -1
        self.events: list[Event] = []
        """Every event of the run so far (also written to the sinks)."""
        self._gradients = options is not None and options.gradients
        self._outputs = options is not None and options.outputs
        self._self_ref = weakref.ref(self)
        self._gradient_checks: list[tuple[int, str]] = []
        """``(layer, tensor_path)`` of each gradient check of compiled graphs, by number."""
        self._gradient_numbers: dict[tuple[int, str], int] = {}
        self._replayer: Replayer | None = None
        """Replay mode: re-runs a step on an event (:meth:`bind_replayer`)."""
        self._parameters: tuple[tuple[int, str, Tensor], ...] = ()
        """Replay mode: the selected modules' parameters, ``(layer, "name.grad", parameter)``,
        whose gradients the backward-end check reads."""
        self._root_type = ""
        self._step_hook: RemovableHandle | None = None
        """Replay mode on an accelerator: the optimizer step pre-hook that reads the flags of
        the step's backward before its optimizer step (:meth:`_pending_before_step`)."""

    def bind_replayer(self, replayer: Replayer, root_type: str) -> None:
        """Replay mode (the observer, at attach): the replayer, and the root's class name
        (the module of events that name the root, layer ``''``)."""
        self._replayer = replayer
        self._root_type = root_type
        self._parameters = tuple(
            (layer, f"{name}.grad", parameter) for layer, name, parameter in replayer.parameters()
        )

    @property
    def replays(self) -> bool:
        """Whether this is replay mode (checks at the root, a replay on an event)."""
        return self._replayer is not None

    def bind_latest(self, latest: Callable[[], int]) -> None:
        """Where the index of the latest root forward started comes from (the gate)."""
        self._latest = latest

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def checks_gradients(self) -> bool:
        """Whether the gradients flowing into the outputs are checked."""
        return self._gradients

    # ------------------------------------------------------------------ the checks

    def begin(
        self, index: int, args: tuple[object, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> None:
        """An outermost root forward starts on this thread (replay mode keeps its arguments,
        ``args`` and ``kwargs``, and RNG states for a replay)."""
        forward = self._local.forward = Forward(index)
        if self._replayer is not None:
            try:
                forward.step = StepRecord(args, kwargs)
            except Exception as error:  # the forward goes on; a replay of it is refused
                forward.unkept = (
                    f"its arguments could not be kept ({type(error).__name__}: {error})"
                )

    def end_root(self, output: object) -> None:
        """Replay mode: the outermost root forward of this thread ended with ``output``: check
        its tensors (on an accelerator, ask for the flags and act on the ones asked for one
        root forward ago) and, with gradients, hook the backward nodes that made them."""
        forward: Forward | None = getattr(self._local, "forward", None)
        self._local.forward = None
        self._settle()
        if forward is None or self._closed:
            return
        leaves = (("", output),) if isinstance(output, Tensor) else tensor_leaves(output)
        hooked = self._gradients and torch.is_grad_enabled()
        for position, (_, tensor) in enumerate(leaves):
            if hooked and tensor.requires_grad:
                node = tensor.grad_fn
                if node is None:
                    continue
                check = RootGradient(self._self_ref, forward, position, tensor.output_nr)
                node.register_prehook(check)
                watch = forward.watch
                if watch is None:
                    watch = forward.watch = Watch()
                watch.probes.append(weakref.ref(check))
                forward.watched = True
        if leaves:
            forward.device = leaves[0][1].device
        result = check_all((ROOT, path, tensor) for path, tensor in leaves) if self._outputs else []
        if isinstance(result, PendingRead):
            read = result

            def act() -> None:
                self._outputs_read(forward, read.result(), watched=forward.watched)

            with self._lock:
                self._pending.append((None, act))
            return
        self._outputs_read(forward, result, watched=forward.watched)

    def backward_ended(self, forward: Forward) -> None:
        """Replay mode: a backward through ``forward``'s output ended (after the reductions
        across ranks): check the gradients of the selected parameters and of the root's
        inputs that require grad."""
        try:
            step = forward.step
            entries = []
            for layer, path, parameter in self._parameters:
                grad = parameter.grad
                if grad is not None:
                    entries.append((layer, path, grad))
            if step is not None:
                for path, tensor in step.inputs_with_gradients():
                    grad = tensor.grad
                    if grad is not None:
                        entries.append((ROOT, path, grad))
            if entries:
                forward.device = entries[0][2].device
            result = check_all(entries)
            if isinstance(result, PendingRead):
                read = result

                def act() -> None:
                    self._backward_read(forward, read.result())

                self._pending_before_step(read.ready, act)
                return
            self._backward_read(forward, result)
        except Exception as error:
            self._errors.handle(SENTINEL_STAGE, error)

    def _pending_before_step(self, ready: Callable[[], bool], act: Callable[[], None]) -> None:
        """An accelerator's backward flags in flight: acted on at the next optimizer step's
        start at the latest (torch's global optimizer step pre-hook, installed with the first
        such read), so that a replay runs on the step's own parameters."""
        with self._lock:
            self._pending.append((ready, act))
            if self._step_hook is not None or self._closed:
                return
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._step_hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: object, args: object, kwargs: object) -> None:
        """Torch's global optimizer step pre-hook (replay mode on an accelerator): wait for
        the flags in flight and act on them (a replay sees the parameters of the step)."""
        try:
            self._settle(wait=True)
        except Exception as error:
            self._errors.handle(SENTINEL_STAGE, error)

    def _backward_read(self, forward: Forward, flagged: Flagged) -> None:
        try:
            self._gradients_read(forward.index, flagged, forward)
        finally:
            if forward.step is not None:
                forward.step.output_grads.clear()  # kept for a replay of this backward only

    def check(self, layer: int, output: object, *, last: bool = False) -> None:
        """A selected module returned ``output`` in this thread's root forward (``last``: the
        root's own output, checked after every other check of the forward, whose flags come
        after the slots' anyway: it needs no slot)."""
        forward: Forward | None = getattr(self._local, "forward", None)
        if forward is None:
            return
        leaves = (("", output),) if isinstance(output, Tensor) else tensor_leaves(output)
        outputs = forward.outputs if self._outputs else None
        gradients = self._gradients and torch.is_grad_enabled()
        slotted = self.slots.active and not last  # a compiled run: checks write slots
        for path, tensor in leaves:
            if outputs is not None and not (
                slotted and slot_check(self.slots, forward.calls, layer, path, tensor)
            ):
                outputs.add(layer, path, tensor)
            if gradients and tensor.requires_grad:
                node = tensor.grad_fn
                if node is None:  # a leaf: no backward node feeds it
                    continue
                # A pre-hook of the node that produced the tensor: it receives the gradient
                # flowing into each of the node's outputs, this one's at ``output_nr`` (the
                # same value as a tensor hook, at two thirds of its registration cost).
                check = GradientCheck(self._self_ref, forward, layer, path, tensor.output_nr)
                node.register_prehook(check)
                watch = forward.watch
                if watch is None:
                    watch = forward.watch = Watch()
                watch.probes.append(weakref.ref(check))
                forward.watched = True

    def check_values(
        self,
        layer: int,
        paths: Sequence[str],
        values: Sequence[Tensor],
        *,
        watched: bool,
        order: Tensor | None = None,
    ) -> None:
        """What a compiled graph computed for one call: whether each tensor is finite (a 0-d
        bool each); ``watched``: the graph's backward checks the gradient of one of them (the
        forward is re-armed only once that check is clean too, as in eager mode); ``order``:
        the slots' counter at this call (where it falls among the slots' flags), or None."""
        forward: Forward | None = getattr(self._local, "forward", None)
        if forward is None:
            forward = self._local.forward = Forward(self._latest())
        if watched and self._gradients:
            forward.watched = True
        for path, value in zip(paths, values, strict=True):
            forward.outputs.add_value(layer, path, value, order)

    def gradient_check(self, layer: int, path: str) -> int:
        """Trace time: the number of the gradient check of ``layer``'s tensor at ``path`` in
        compiled graphs (the same for every graph and call)."""
        with self._lock:
            number = self._gradient_numbers.get((layer, path))
            if number is None:
                number = self._gradient_numbers[layer, path] = len(self._gradient_checks)
                self._gradient_checks.append((layer, path))
            return number

    def check_gradient_finite(self, check: int, finite: Tensor) -> None:
        """A compiled graph's gradient check (whether the gradient flowing into one output is
        finite, numbered by :meth:`gradient_check`), for the latest root forward that ended (a
        compiled graph carries no forward identity). Once per checked output per compiled
        backward: kept to a few attribute reads when clean."""
        forward = self._last
        if forward is None or self._closed or not self._gradients:
            return  # (a graph checks gradients only when the sentinel does: a safeguard)
        flush = forward.gradients
        if flush is None:
            flush = forward.gradients = GradientFlush(self._self_ref, forward)
        layer, path = self._gradient_checks[check]
        flush.flags.add_value(layer, path, finite)
        if not flush.queued:
            flush._queue()

    def end(self, current: list[Tensor] | None = None) -> None:
        """The outermost root forward ended on this thread: read its flags and the slots (on
        an accelerator, ask for them and act on the ones asked for one root forward ago).
        ``current``: the slots as the graph that ends the forward holds them (its root hooks
        traced: it writes them back after this)."""
        forward: Forward | None = getattr(self._local, "forward", None)
        self._local.forward = None
        self._settle()
        if not self._closed:
            self._read_gradient_slots()
        if forward is None and self.slots.active:  # root hooks traced: no eager begin
            forward = Forward(self._latest())
        if forward is None or self._closed:
            return
        self._last = forward
        result = forward.outputs.read()
        slotted: Keyed | PendingSlots = self.slots.read(current) if self.slots.active else []
        # A compiled graph that checks a slotted output's gradient (``ti::check_grad``): its
        # forward is re-armed only once that check is clean too, as in eager mode. (Inside a
        # graph's operator, ``current``, the caller's grad mode is not visible: assumed on.)
        watched = forward.watched or (
            self._gradients
            and self.slots.gradient_hooks
            and (current is not None or torch.is_grad_enabled())
        )
        if isinstance(result, PendingRead) or isinstance(slotted, PendingSlots):

            def act() -> None:
                flagged = result.result() if isinstance(result, PendingRead) else result
                found = slotted.result() if isinstance(slotted, PendingSlots) else slotted
                merged = merge(found, flagged, forward.outputs.keys)
                self._outputs_read(forward, merged, watched=watched)

            with self._lock:
                self._pending.append((None, act))
            return
        merged = merge(slotted, result, forward.outputs.keys)
        self._outputs_read(forward, merged, watched=watched)

    def _read_gradient_slots(self) -> None:
        """The gradient slots the backwards since the previous read wrote (no Python runs in
        an inductor backward graph to say when it ends), for the latest root forward that
        ended, in the order the gradients arrived; nothing when no gradient check ran."""
        slots = self.gradient_slots
        forward = self._last
        if forward is None or not slots.active:
            return
        index = forward.index
        found = slots.read()
        if isinstance(found, PendingSlots):
            pending = found

            def act() -> None:
                keyed = pending.result()
                if slots.ran:
                    self._gradients_read(index, [entry for _, entry in keyed])

            with self._lock:
                self._pending.append((pending.ready, act))
            return
        if slots.ran:
            self._gradients_read(index, [entry for _, entry in found])

    def _settle(self, *, wait: bool = False) -> None:
        """Act on the reads asked for earlier (those ready, or all when ``wait``)."""
        if not self._pending:
            return
        with self._lock:
            pending, self._pending = self._pending, []
        later = []
        for item in pending:
            ready, act = item
            if wait or ready is None or ready():
                act()
            else:
                later.append(item)
        if later:
            with self._lock:
                self._pending[:0] = later

    def _outputs_read(self, forward: Forward, flagged: Flagged, *, watched: bool) -> None:
        index = forward.index
        if flagged:
            self._fire("output", index, flagged, forward)
            return
        with self._lock:
            if watched:  # clean so far: re-armed once its gradients are clean too
                self._clean_outputs[index] = forward.watch
                while len(self._clean_outputs) > _RECENT:
                    del self._clean_outputs[next(iter(self._clean_outputs))]
            else:
                self._rearm_locked(index)

    def _rearm_abandoned_locked(self) -> None:
        """Waiting forwards whose graph is gone without a backward count as clean (their
        gradient check will never come): they re-arm as a clean gradient check would."""
        for index, watch in list(self._clean_outputs.items()):
            if watch is not None and watch.abandoned():
                del self._clean_outputs[index]
                self._rearm_locked(index)

    def gradients_checked(self, index: int, flags: Flags) -> None:
        """One backward's gradient checks for root forward ``index`` are complete."""
        result = flags.read()
        if isinstance(result, PendingRead):
            read = result

            def act() -> None:
                self._gradients_read(index, read.result())

            with self._lock:
                self._pending.append((read.ready, act))
            return
        self._gradients_read(index, result)

    def _gradients_read(self, index: int, flagged: Flagged, forward: Forward | None = None) -> None:
        if flagged:
            with self._lock:
                self._clean_outputs.pop(index, None)
            self._fire("output_gradient", index, flagged, forward)
            return
        with self._lock:
            if index in self._clean_outputs:
                del self._clean_outputs[index]
                self._rearm_locked(index)

    def _rearm_locked(self, index: int) -> None:
        """Root forward ``index`` was clean: re-arm, if it came after the latest event."""
        if index > self._fired_at:
            self._armed = True

    # ------------------------------------------------------------------ events

    def _fire(
        self, signal: str, index: int, flagged: Flagged, forward: Forward | None = None
    ) -> None:
        with self._lock:
            if not self._armed:
                self._rearm_abandoned_locked()
            if not self._armed or self._closed:
                return
            self._armed = False
            self._fired_at = index
        assert self.options is not None
        layers = tuple(layer for layer, _ in flagged)
        paths = tuple(path for _, path in flagged)
        verdict = None
        if self._replayer is not None:
            verdict = self._replay(signal, forward)
            if verdict.layers:
                layers, paths = verdict.layers, verdict.paths
        self._record(
            "nonfinite",
            index,
            self.options.dense_forwards,
            signal=signal,
            layers=tuple(self._name(layer) for layer in layers),
            module_types=tuple(self._type(layer) for layer in layers),
            tensor_paths=paths,
            replay=None if verdict is None else verdict.replay,
            replay_reason=None if verdict is None else verdict.reason,
        )

    def _replay(self, signal: str, forward: Forward | None) -> Verdict:
        """The replay's verdict on the step of ``forward`` (never raises)."""
        replayer = self._replayer
        assert replayer is not None
        step = None if forward is None else forward.step
        if forward is None or step is None:
            return Verdict(
                "not_replayable",
                forward.unkept if forward is not None else TRACED_ROOT,
            )
        try:
            return replayer.replay(step, signal, str(forward.device))
        except Exception as error:
            return Verdict("not_replayable", f"the replay raised {type(error).__name__}: {error}")

    def _name(self, layer: int) -> str:
        return "" if layer == ROOT else self._names[layer]

    def _type(self, layer: int) -> str:
        return self._root_type if layer == ROOT else self._types[layer]

    def trigger(
        self,
        kind: EventKind,
        *,
        forwards: int | None,
        reason: str | None,
        value: float | None = None,
    ) -> Event | None:
        """Record a ``manual`` or ``loss`` event and sample the next ``forwards`` root
        forwards in full (default: the sentinel's ``dense_forwards``, else 4)."""
        if forwards is None:
            options = self.options
            forwards = options.dense_forwards if options is not None else DEFAULT_DENSE_FORWARDS
        if self._closed:
            return None
        return self._record(kind, self._latest(), forwards, reason=reason, value=value)

    def _record(
        self, kind: EventKind, index: int, forwards: int, **details: Unpack[EventDetails]
    ) -> Event:
        event = Event(
            event_id=next(self._ids),
            kind=kind,
            forward_index=index,
            timestamp_us=now_us(),
            dense_first_forward=self.dense.trigger(forwards),
            dense_forwards=forwards,
            **details,
        )
        with self._lock:
            self.events.append(event)
        self._write(event_batch(event, self._schema, self._run_id, self._rank))
        return event

    def close(self) -> None:
        """Act on every read still in flight (and the gradient slots of the last backward),
        then record nothing more."""
        try:
            self._read_gradient_slots()
            self._settle(wait=True)
        except Exception as error:
            self._errors.handle(SENTINEL_STAGE, error)
        self._closed = True
        with self._lock:
            hook, self._step_hook = self._step_hook, None
        if hook is not None:
            hook.remove()


__all__ = ["SENTINEL_STAGE", "FlightRecorder", "GradientCheck"]
