"""Which process observes: the rank-policy contract between ti-core and the policies.

ti-core asks a policy once, at attach (``RankPolicy.select``); ti-dist implements the named
policies (``rank0``, ``all``, ``Ranks``). Both import these types from here, and ti-core
re-exports them (``ti_core.RankPolicy``, ``ti_core.RankSelection``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class RankSelection:
    """What a rank policy decided for this process."""

    rank: int
    world_size: int
    observe: bool
    """False: attach nothing on this process (no hooks, no files)."""
    subdir: str | None = None
    """Rank-private subdirectory for file sinks (``rank-003``, see
    :func:`ti_schema.layout.rank_dir_name`); None writes in place."""


@runtime_checkable
class RankPolicy(Protocol):
    """Decides, once at attach time, whether and where this process observes."""

    def select(self) -> RankSelection:
        """Detect this process's rank and return the decision for it."""
        ...
