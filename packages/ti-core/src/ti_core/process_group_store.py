"""The one private PyTorch API aligned sampling relies on: the default process group's store.

``torch.distributed`` has no public accessor for the key-value store that
``init_process_group`` created (the rendezvous store every rank of the job reaches);
``distributed_c10d._get_default_store`` returns it. torch is pinned (constraints/torch.txt);
``packages/ti-core/tests/test_aligned_sampling.py`` checks this name on the pinned torch, so an
upgrade that moves it fails there, naming it. Only the store's public methods (``set``, ``get``,
``check``, ``compare_set``) are used on what it returns.
"""

from __future__ import annotations

from typing import Any


def default_store() -> Any | None:
    """The default process group's store, or None when no default process group is initialized
    (or torch has no ``torch.distributed``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


__all__ = ["default_store"]
