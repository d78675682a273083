"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): what this rank holds, and
how its rows say so (docs/data-contract.md, "Signals")."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

# Looked up, never imported: importing torch.distributed.tensor costs about 0.4 s and 40 MB
# (sympy, symbolic shapes) in every process, and a DTensor can only exist once whoever made it
# (FSDP2, tensor parallelism, the user) has imported that module.
_DTENSOR_MODULE = "torch.distributed.tensor"


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (each rank holds a local part, e.g. FSDP2's shards)."""
    module = sys.modules.get(_DTENSOR_MODULE)
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``tensor``: a DTensor's local part, else the tensor itself;
    detached."""
    if is_sharded(tensor):
        tensor = tensor.to_local()  # type: ignore[attr-defined]
    return tensor.detach()


def parameter_path(name: str, param: torch.Tensor) -> str:
    """The ``tensor_path`` of a parameter: its name in the module; a DTensor adds ``@`` and its
    placements, one per mesh dimension as DTensor prints them (``weight@S(0)``)."""
    if not is_sharded(param):
        return name
    placements: Sequence[object] = param.placements  # type: ignore[attr-defined]
    return f"{name}@{','.join(str(p) for p in placements)}"


__all__ = ["is_sharded", "local_tensor", "parameter_path"]
