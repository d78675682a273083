"""Rows of a pipeline-parallel stage (``torch.distributed.pipelining``): which stage, step and
microbatch each belongs to.

A stage observed with ``ti_core.inject_stage_observer`` records only the forwards its schedule
runs for microbatches (a schedule's own warm-up or shape-inference forward is not counted), and
every schedule runs a stage's microbatches ``0 .. m-1`` in order once per step (GPipe, 1F1B,
and each stage of the interleaved schedules). So the stage's ``forward_index`` is
``step * m + microbatch``, with ``m`` the schedule's ``n_microbatches``, recorded in the run's
settings under :data:`PIPELINE_MICROBATCHES` beside the stage's index (:data:`PIPELINE_STAGE`)
and count (:data:`PIPELINE_STAGES`). The observer checks the order at every microbatch and
warns if a schedule breaks it. Contract 1.5. Readers: :func:`step_and_microbatch`,
``ti_dist.pipeline_rows``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

PIPELINE_STAGE: Final[str] = "pipeline_stage"
"""Run setting: the stage's index (0-based)."""
PIPELINE_STAGES: Final[str] = "pipeline_stages"
"""Run setting: the number of stages of the pipeline."""
PIPELINE_MICROBATCHES: Final[str] = "pipeline_microbatches"
"""Run setting: microbatches per step (the schedule's ``n_microbatches``)."""


@dataclass(frozen=True)
class PipelineStageFacts:
    """What a stage's run settings say of it."""

    stage: int
    stages: int
    microbatches: int

    def settings(self) -> dict[str, str]:
        """The run settings that record these facts."""
        return {
            PIPELINE_STAGE: str(self.stage),
            PIPELINE_STAGES: str(self.stages),
            PIPELINE_MICROBATCHES: str(self.microbatches),
        }


def pipeline_stage_of(settings: Mapping[str, str]) -> PipelineStageFacts | None:
    """The stage facts of a run's settings; None for a run that is not a pipeline stage's (or
    whose settings are malformed)."""
    try:
        facts = PipelineStageFacts(
            int(settings[PIPELINE_STAGE]),
            int(settings[PIPELINE_STAGES]),
            int(settings[PIPELINE_MICROBATCHES]),
        )
    except (KeyError, ValueError):
        return None
    valid = 0 <= facts.stage < facts.stages and facts.microbatches >= 1
    return facts if valid else None


def step_and_microbatch(forward_index: int, microbatches: int) -> tuple[int, int]:
    """The step and microbatch of a stage's root forward ``forward_index`` (module
    docstring)."""
    return divmod(forward_index, microbatches)


__all__ = [
    "PIPELINE_MICROBATCHES",
    "PIPELINE_STAGE",
    "PIPELINE_STAGES",
    "PipelineStageFacts",
    "pipeline_stage_of",
    "step_and_microbatch",
]
