"""Which process observes: the rank-policy contract (from ti-schema) and core's distributed test.

``RankPolicy`` and ``RankSelection`` live in :mod:`ti_schema.ranks` (ti-dist implements the
policies against them without importing ti-core); they are re-exported here. ti-core never
imports ti-dist; named policies are found through the ``ti.rank_policies`` entry point group
(``rank0`` and ``all`` are registered by ti-dist).
"""

from __future__ import annotations

import os

from ti_schema.ranks import RankPolicy, RankSelection

__all__ = ["RankPolicy", "RankSelection", "visibly_distributed"]


def visibly_distributed() -> bool:
    """True when the job is distributed: ``WORLD_SIZE > 1`` or an initialized process group."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return True
    except ValueError:
        pass
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
