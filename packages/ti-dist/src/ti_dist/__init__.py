"""ti-dist: rank detection, rank policies and cross-rank reading for torch.distributed jobs.

``rank_policy="rank0"`` (the default of ``ti_core.inject_observer``) and ``rank_policy="all"``
resolve to :class:`Rank0Only` and :class:`AllRanks` through the ``ti.rank_policies`` entry points.
The readers (``scan_ranks``, ``compare_ranks``, ``replica_drift``, ``first_drift``,
``combine_shards``, ``events_across_ranks``, ``first_event``, ...) import Polars on first use,
so resolving a policy on a training rank does not. ``ti drift`` (:mod:`ti_dist.drift_command`)
joins ti-io's ``ti`` through the ``ti.commands`` entry points.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ti_dist.detect import RankDetectionError, RankInfo, detect_rank
from ti_dist.policies import AllRanks, Rank0Only, Ranks, rank_subdir

if TYPE_CHECKING:
    from ti_dist.compare import compare_ranks
    from ti_dist.drift import Drift, first_drift, replica_drift
    from ti_dist.events import events_across_ranks, first_event
    from ti_dist.pipelines import pipeline_rows
    from ti_dist.reading import (
        HistorySource,
        collect_streaming,
        find_history_sources,
        scan_ranks,
    )
    from ti_dist.shards import combine_shards

_LAZY = {
    "combine_shards": "ti_dist.shards",
    "compare_ranks": "ti_dist.compare",
    "Drift": "ti_dist.drift",
    "first_drift": "ti_dist.drift",
    "replica_drift": "ti_dist.drift",
    "events_across_ranks": "ti_dist.events",
    "first_event": "ti_dist.events",
    "pipeline_rows": "ti_dist.pipelines",
    "HistorySource": "ti_dist.reading",
    "collect_streaming": "ti_dist.reading",
    "find_history_sources": "ti_dist.reading",
    "scan_ranks": "ti_dist.reading",
}

__all__ = [
    "AllRanks",
    "Drift",
    "HistorySource",
    "Rank0Only",
    "RankDetectionError",
    "RankInfo",
    "Ranks",
    "collect_streaming",
    "combine_shards",
    "compare_ranks",
    "detect_rank",
    "events_across_ranks",
    "find_history_sources",
    "first_drift",
    "first_event",
    "pipeline_rows",
    "rank_subdir",
    "replica_drift",
    "scan_ranks",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ti_dist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
