"""Observing one stage of a pipeline-parallel job (``torch.distributed.pipelining``).

Each rank observes the stage it runs: the stage's module (``stage.submod``), recorded only
while the schedule runs one of its microbatches (``PipelineStage.forward_one_chunk``), so its
``forward_index`` is ``step * microbatches + microbatch`` (``ti_schema.pipeline``). A
schedule's own forwards outside the microbatches (a warm-up or shape inference) are neither
counted nor recorded. Layer names are those of the stage's module: a stage built by keeping a
part of the whole model (``model[:3]``, or torchtitan's pruned copies) keeps the model's own
fully qualified names.

Ownership: :class:`MicrobatchScope` wraps the stage's ``forward_one_chunk`` (an instance
attribute, the class untouched); :func:`inject_stage_observer` installs it after the observer,
:func:`remove_stage_observer` removes it before the observer.
"""

from __future__ import annotations

import warnings
from typing import Any, Final, Unpack

from torch import nn

from ti_core.api.observe import inject_observer, observer_of, remove_observer
from ti_core.errors import TelemetryWarning
from ti_core.options import ObserverOptions
from ti_schema import PipelineStageFacts

_SCOPE: Final[str] = "_ti_microbatch_scope"
"""The stage's attribute holding its :class:`MicrobatchScope` while observed."""


class MicrobatchScope:
    """The stage's ``forward_one_chunk``, wrapped: the observer records inside it, and checks
    that the microbatches come in the order the rows' step and microbatch are derived from."""

    def __init__(self, stage: Any, microbatches: int) -> None:
        self._stage = stage
        self._microbatches = microbatches
        self._original = stage.forward_one_chunk
        self._warned = False

    def install(self) -> None:
        self._stage.__dict__[_SCOPE] = self
        self._stage.forward_one_chunk = self.forward_one_chunk

    def remove(self) -> None:
        self._stage.__dict__.pop(_SCOPE, None)
        if self._stage.__dict__.get("forward_one_chunk") == self.forward_one_chunk:
            del self._stage.forward_one_chunk

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        observer = observer_of(self._stage.submod)
        if observer is None:
            return self._original(fwd_chunk_id, *args, **kwargs)
        gate = observer.gate
        upcoming = gate.latest_forward + 1
        if fwd_chunk_id != upcoming % self._microbatches and not self._warned:
            self._warned = True
            warnings.warn(
                f"ti-core: pipeline stage {self._stage.stage_index}: root forward {upcoming} "
                f"runs microbatch {fwd_chunk_id}, not {upcoming % self._microbatches} of "
                f"{self._microbatches}: the step and microbatch derived from forward_index are "
                "wrong from here on (pass inject_stage_observer(microbatches=) the schedule's "
                "n_microbatches)",
                TelemetryWarning,
                stacklevel=2,
            )
        with gate.within():
            return self._original(fwd_chunk_id, *args, **kwargs)


def _check_stage(stage: Any) -> nn.Module:
    submod = getattr(stage, "submod", None)
    if not isinstance(submod, nn.Module) or not callable(getattr(stage, "forward_one_chunk", None)):
        raise TypeError(
            "stage must be a torch.distributed.pipelining.PipelineStage (with .submod and "
            f"forward_one_chunk), got {type(stage).__name__}; for a plain module use "
            "inject_observer"
        )
    return submod


def inject_stage_observer(
    stage: Any, *, microbatches: int, **options: Unpack[ObserverOptions]
) -> None:
    """Observe the pipeline stage this rank runs (module docstring).

    ``stage``: a ``torch.distributed.pipelining.PipelineStage``; ``microbatches``: its
    schedule's ``n_microbatches``. ``options`` are :func:`inject_observer`'s (typically
    ``rank_policy="all"``: each rank holds another stage); the stage's index, stage count and
    ``microbatches`` are recorded in the run's settings (``ti_schema.pipeline``). Call before
    the schedule's first step.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"microbatches= must be the schedule's n_microbatches (an int >= 1), got "
            f"{microbatches!r}"
        )
    submod = _check_stage(stage)
    facts = PipelineStageFacts(int(stage.stage_index), int(stage.num_stages), microbatches)
    options["settings"] = {**(options.get("settings") or {}), **facts.settings()}
    inject_observer(submod, **options)
    observer = observer_of(submod)
    if observer is None:  # the rank policy: this rank does not observe
        return
    observer.as_pipeline_stage(facts.stage, facts.stages)
    MicrobatchScope(stage, microbatches).install()


def remove_stage_observer(stage: Any) -> None:
    """Detach what :func:`inject_stage_observer` attached (a no-op when nothing is)."""
    submod = _check_stage(stage)
    scope = stage.__dict__.get(_SCOPE)
    if isinstance(scope, MicrobatchScope):
        scope.remove()
    remove_observer(submod)


__all__ = ["MicrobatchScope", "inject_stage_observer", "remove_stage_observer"]
