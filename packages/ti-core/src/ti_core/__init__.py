"""ti-core: passive PyTorch telemetry (capture, sampling, reduction) delivering records to sinks."""

from __future__ import annotations

from ti_core.aligned_sampling import AlignedSampler
from ti_core.api import (
    has_observer,
    inject_observer,
    inject_stage_observer,
    observe,
    observer_of,
    remove_observer,
    remove_stage_observer,
    trigger_capture,
)
from ti_core.budget import BudgetSampler
from ti_core.errors import (
    ErrorPolicyName,
    MissingProviderError,
    ObserverAlreadyAttachedError,
    TelemetryWarning,
)
from ti_core.memory_sink import MemorySink
from ti_core.ranks import RankPolicy, RankSelection
from ti_core.reduction.plan import DefaultProfile, Reducer, default_reducers
from ti_core.sampling import (
    AheadSchedule,
    AlwaysSampler,
    EveryNForwardsSampler,
    Sampler,
    TimedSampler,
)
from ti_core.selection import leaf_modules
from ti_core.sentinel import Event, Sentinel
from ti_core.sink import LayerInfo, RunCost, RunInfo, Sink, SinkCapabilities

__all__ = [
    "AheadSchedule",
    "AlignedSampler",
    "AlwaysSampler",
    "BudgetSampler",
    "DefaultProfile",
    "ErrorPolicyName",
    "Event",
    "EveryNForwardsSampler",
    "LayerInfo",
    "MemorySink",
    "MissingProviderError",
    "ObserverAlreadyAttachedError",
    "RankPolicy",
    "RankSelection",
    "Reducer",
    "RunCost",
    "RunInfo",
    "Sampler",
    "Sentinel",
    "Sink",
    "SinkCapabilities",
    "TelemetryWarning",
    "TimedSampler",
    "default_reducers",
    "has_observer",
    "inject_observer",
    "inject_stage_observer",
    "leaf_modules",
    "observe",
    "observer_of",
    "remove_observer",
    "remove_stage_observer",
    "trigger_capture",
]
