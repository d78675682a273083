"""ti-dist: rank detection, rank policies and cross-rank reading for torch.distributed jobs.

``rank_policy="rank0"`` (the default of ``ti_core.inject_observer``) and ``rank_policy="all"``
resolve to :class:`Rank0Only` and :class:`AllRanks` through the ``ti.rank_policies`` entry points.
"""

from __future__ import annotations

from ti_dist.compare import compare_ranks
from ti_dist.detect import RankDetectionError, RankInfo, detect_rank
from ti_dist.policies import AllRanks, Rank0Only, Ranks, rank_subdir
from ti_dist.reading import HistorySource, collect_streaming, find_history_sources, scan_ranks

__all__ = [
    "AllRanks",
    "HistorySource",
    "Rank0Only",
    "RankDetectionError",
    "RankInfo",
    "Ranks",
    "collect_streaming",
    "compare_ranks",
    "detect_rank",
    "find_history_sources",
    "rank_subdir",
    "scan_ranks",
]
