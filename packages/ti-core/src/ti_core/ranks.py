"""Which process observes: the rank-policy protocol and core's fallback without ti-dist.

ti-core never imports ti-dist; named policies are found through the ``ti.rank_policies`` entry
point group (``rank0`` and ``all`` are registered by ti-dist).
"""

from __future__ import annotations

import os
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
    """Rank-private subdirectory for file sinks (e.g. ``rank-003``); None writes in place."""


@runtime_checkable
class RankPolicy(Protocol):
    """Decides, once at attach time, whether and where this process observes."""

    def select(self) -> RankSelection:
        """Detect this process's rank and return the decision for it."""
        ...


def visibly_distributed() -> bool:
    """True when the job is distributed: ``WORLD_SIZE > 1`` or an initialized process group."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return True
    except ValueError:
        pass
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
