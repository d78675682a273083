"""What telemetry cost a run, as the producer measured it in the run itself.

:class:`RunCost` is handed to sinks that declare ``SinkCapabilities(write_cost=...)`` (at
removal, and before each flush so that a crashed run keeps its latest figure), and is stored by
ti-io as the ``telemetry_cost`` run fact (contract 1.4): in ``run.json`` while the run is live,
then in the ``ti`` footer of ``history.parquet``. :meth:`RunCost.to_doc` /
:meth:`RunCost.from_doc` are that JSON object.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

COST_METHOD: Final[str] = (
    "sampled steps and worker-overlapped unsampled steps minus the median clean unsampled step"
)
"""The method ti-core's meter uses (docs/capture.md, "What telemetry cost the run")."""


@dataclass(frozen=True)
class RunCost:
    """The training-thread time telemetry added to one run, and what it was measured from.

    A *step* is the time from one root forward's start to the next one's (forward, backward,
    optimizer step, data loading). ``telemetry_seconds`` is the time the measured sampled steps,
    and the unsampled steps that background work of the samples overlapped, took beyond clean
    unsampled ones: for each kind, their number times the difference of its median and the clean
    median (each over the latest steps of its kind, so a pause of the loop in one step does not
    count);
    ``fraction`` is that over ``wall_seconds`` (attach to the time of the figure). ``None``: not
    measurable (no unsampled step to compare with, or no measured sampled step).
    """

    sampled_forwards: int
    """Sampled root forwards so far."""
    unsampled_forwards: int
    """Unsampled root forwards so far."""
    measured_sampled_steps: int
    """Sampled steps whose time is in ``telemetry_seconds`` (not the run's first step, which
    also carries the model's own warmup, nor one still running)."""
    wall_seconds: float
    """From attach to this figure."""
    telemetry_seconds: float | None
    fraction: float | None
    """``telemetry_seconds / wall_seconds``. Both may be slightly negative when telemetry costs
    less than the steps' own spread (the difference of the medians is kept signed, so noise
    does not add up)."""
    median_unsampled_step_seconds: float | None
    """Median of the latest *clean* unsampled steps: those the producer's background work
    (ti-core's emission worker) did not overlap."""
    median_sampled_step_seconds: float | None
    """Median of the latest measured sampled steps."""
    method: str = COST_METHOD
    worker_overlap_steps: int = 0
    """Unsampled steps during which the background work of earlier samples was still running;
    their time beyond ``median_unsampled_step_seconds`` is telemetry too."""
    median_worker_overlap_step_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "sampled_forwards",
            "unsampled_forwards",
            "measured_sampled_steps",
            "worker_overlap_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RunCost({name}=...) must be an int >= 0, got {value!r}")
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name.endswith(("_seconds", "fraction")) and value is not None:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise TypeError(f"RunCost({spec.name}=...) must be a float, got {value!r}")
                signed = spec.name in ("telemetry_seconds", "fraction")
                if not math.isfinite(value) or (value < 0 and not signed):
                    raise ValueError(
                        f"RunCost({spec.name}=...) must be finite and >= 0, got {value!r}"
                    )
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"RunCost(method=...) must be a non-empty string, got {self.method!r}")

    def to_doc(self) -> dict[str, Any]:
        """The JSON object of the ``telemetry_cost`` run fact."""
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: object) -> RunCost | None:
        """The cost a ``telemetry_cost`` object describes, or None when it is not one."""
        if not isinstance(doc, Mapping):
            return None
        names = {spec.name for spec in fields(cls)}
        try:
            return cls(**{k: v for k, v in doc.items() if k in names})
        except (TypeError, ValueError):
            return None

    def describe(self) -> str:
        """One line for people, e.g. ``0.8 % of 512 s wall time (sampled steps cost 3.1 ms more
        than the median unsampled step, 12.0 ms)``."""
        counts = f"{self.sampled_forwards} sampled, {self.unsampled_forwards} unsampled forwards"
        if self.fraction is None or self.telemetry_seconds is None:
            return (
                f"not measured over {self.wall_seconds:.3g} s wall time ({counts}: it needs "
                "unsampled steps and a sampled step after the first)"
            )
        median = self.median_unsampled_step_seconds or 0.0
        extra = (self.median_sampled_step_seconds or 0.0) - median
        overlap = ""
        if self.worker_overlap_steps and self.median_worker_overlap_step_seconds is not None:
            slower = self.median_worker_overlap_step_seconds - median
            overlap = (
                f"; {self.worker_overlap_steps} unsampled steps overlapped by the samples' "
                f"background work cost {1000 * slower:.3g} ms more"
            )
        return (
            f"{100 * self.fraction:.2g} % of {self.wall_seconds:.3g} s wall time (sampled steps "
            f"cost {1000 * extra:.3g} ms more than the median unsampled step, "
            f"{1000 * median:.3g} ms{overlap}; {counts})"
        )


def cost_problem(doc: object) -> str | None:
    """Why ``doc`` is not a ``telemetry_cost`` object, or None when it is one."""
    if not isinstance(doc, Mapping):
        return f"'telemetry_cost' must be a JSON object, got {doc!r}"
    missing = [
        s.name for s in fields(RunCost) if s.name not in doc and s.default is dataclasses.MISSING
    ]
    if missing:
        return f"'telemetry_cost' lacks {missing}"
    if RunCost.from_doc(doc) is None:
        return f"'telemetry_cost' holds invalid values: {dict(doc)!r}"
    return None


__all__ = ["COST_METHOD", "RunCost", "cost_problem"]
