"""The gate's side of the runtime protocol with compiled graphs (:mod:`ti_core.compiled`).

Under ``torch.compile`` the hooks are traced (:mod:`ti_core.compiled.traced`): at trace time
they call :meth:`~ti_core.gate.Gate.enter_compiled_mode` and :meth:`CompiledGate.intern_paths`;
at run time the ``ti::`` operators in the graphs call the ``compiled_*`` methods here. Where the
root's own hooks are traced into the graph (``COMPILED_AHEAD``), no Python runs before a root
forward, so its decision is taken when the previous one ends: :meth:`CompiledGate.decide_ahead`,
read back by :meth:`CompiledGate.take_ahead`.

:class:`CompiledGate` is a base of :class:`~ti_core.gate.Gate` (one object is the compiled
target, the capture target and the state machine); it reads the gate's state through the
attributes declared below and never changes the state itself.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

import torch

from ti_core import _torch
from ti_core.call_context import in_backward
from ti_core.capture.gradients import GradHook
from ti_core.capture.sample import Sample
from ti_core.capture.traced_calls import record_traced_call, record_traced_start
from ti_core.compiled.operators import TraceFlags
from ti_core.compiled.sites import Sites
from ti_core.errors import ErrorPolicy
from ti_core.gate.root_nesting import ThreadRoots
from ti_core.sampling import Sampler
from ti_core.sentinel.recorder import SENTINEL_STAGE, FlightRecorder
from ti_core.stages import SAMPLING, stage_of

_OUTPUT_CAPTURE = stage_of("output", "capture")


class CompiledGate:
    """The ``CompiledTarget`` of :mod:`ti_core.compiled.operators`, and the decision taken
    ahead."""

    # Owned by the gate (set in its __init__).
    _local: ThreadRoots
    _lock: threading.Lock
    _errors: ErrorPolicy
    _sampler: Sampler
    _counter: itertools.count[int]
    _flags: TraceFlags
    _sites: Sites
    _ahead: tuple[int, bool] | None
    _latest: int
    _sentinel: FlightRecorder | None

    if TYPE_CHECKING:

        @property
        def closed(self) -> bool: ...

        def _start_sample(self, local: ThreadRoots, index: int) -> None: ...

        def _end_sample(self, sample: Sample) -> None: ...

    # ------------------------------------------------------------------ the decision, ahead

    def decide_ahead(self) -> None:
        """Decide the next root forward now, and tell the compiled graphs."""
        try:
            index = next(self._counter)
            sampled = bool(self._sampler.should_sample(index))
        except Exception as error:
            sampled = False
            self._errors.handle(SAMPLING, error)
        self._ahead = (index, sampled)
        self._flags.sampled = sampled

    def take_ahead(self) -> tuple[int, bool]:
        """This root forward's decision, taken ahead (or now, when another thread took it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            return ahead
        index = next(self._counter)
        return index, bool(self._sampler.should_sample(index))

    # ------------------------------------------------------------------ trace time

    def intern_paths(self, paths: tuple[str, ...]) -> int:
        return self._sites.intern(paths)

    def sentinel_slot(
        self, layer: int, site: int, position: int, device: str, watched: bool
    ) -> int:
        sentinel = self._sentinel
        if sentinel is None:
            return -1
        slots = sentinel.slots
        if watched:
            slots.gradient_hooks = True
        path = self._sites.paths(site)[position]
        trace = _torch.current_compile_id()
        return slots.traced_slot(trace, layer, path, torch.device(device))

    def sentinel_gradient_slot(self, layer: int, site: int, position: int, device: str) -> int:
        sentinel = self._sentinel
        if sentinel is None or not _torch.backward_writes_keep_versions():
            return -1
        path = self._sites.paths(site)[position]
        trace = _torch.current_compile_id()
        return sentinel.gradient_slots.traced_slot(trace, layer, path, torch.device(device))

    def sentinel_gradient_check(self, layer: int, site: int, position: int) -> int:
        sentinel = self._sentinel
        if sentinel is None:
            return -1
        return sentinel.gradient_check(layer, self._sites.paths(site)[position])

    def sentinel_counter(self, device: str) -> bool:
        sentinel = self._sentinel
        return sentinel is not None and sentinel.slots.prepare(torch.device(device))

    # ------------------------------------------------------------------ run time (operators)

    def compiled_begin(self) -> None:
        if self.closed or in_backward() or self._local.sample is not None:
            return
        if self._errors.has_deferred:
            self._errors.report_deferred()
        try:
            index, sampled = self.take_ahead()
            self._latest = index
            if sampled:
                self._start_sample(self._local, index)
        except Exception as error:
            self._errors.handle(SAMPLING, error)

    def _compiled_sentinel_end(self, slots: list[torch.Tensor]) -> None:
        """A root forward whose root hooks were traced ended: the sentinel reads its flags
        (``slots``: as the graph holds them)."""
        sentinel = self._sentinel
        if sentinel is None or self.closed:
            return
        try:
            sentinel.end(slots)
        except Exception as error:
            self._errors.handle(SENTINEL_STAGE, error)

    def compiled_end(self, slots: list[torch.Tensor]) -> None:
        if in_backward():
            return
        self._compiled_sentinel_end(slots)
        local = self._local
        sample, local.sample = local.sample, None
        if sample is not None:
            self._end_sample(sample)
        if not self.closed:
            self.decide_ahead()

    def compiled_advance(self, slots: list[torch.Tensor]) -> None:
        if self.closed or in_backward():
            return
        self._compiled_sentinel_end(slots)
        if self._ahead is None:
            next(self._counter)  # another thread took this forward's decision: count it
        self._ahead = None
        self.decide_ahead()

    def compiled_check(
        self,
        values: list[torch.Tensor],
        layer: int,
        site: int,
        watched: bool,
        order: list[torch.Tensor],
    ) -> None:
        sentinel = self._sentinel
        if sentinel is None or self.closed or in_backward():
            return
        try:
            paths = self._sites.paths(site)
            counter = order[0] if order else None
            sentinel.check_values(layer, paths, values, watched=watched, order=counter)
        except Exception as error:
            self._errors.handle(SENTINEL_STAGE, error)

    def compiled_check_grad(self, finite: torch.Tensor, check: int) -> None:
        sentinel = self._sentinel
        if sentinel is None or self.closed:
            return
        try:
            sentinel.check_gradient_finite(check, finite)
        except Exception as error:
            self._errors.handle(SENTINEL_STAGE, error)

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
            self._errors.handle(_OUTPUT_CAPTURE, error)
            return None

    def compiled_record_start(
        self,
        tensors: list[torch.Tensor],
        layer: int,
        site: int,
        train: bool,
        grad_enabled: bool,
        signals: list[int],
    ) -> None:
        sample = self._local.sample
        if sample is None or in_backward():
            return
        try:
            paths = self._sites.paths(site)
            record_traced_start(sample, layer, paths, tensors, train, grad_enabled, signals)
        except Exception as error:  # each signal's own failures are named by the sample
            if sample.starts:
                sample.start_failed(sample.starts[0][0], error)


__all__ = ["CompiledGate"]
