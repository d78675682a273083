"""Tensors that are not plain: DTensors (FSDP2's ``fully_shard``, tensor and sequence
parallelism), nested tensors and other subclasses. What this rank measures of each, and how its
rows say so (``ti_schema.placements``; docs/data-contract.md, "Signals").

Nothing here issues a collective: a DTensor is read through ``to_local()`` only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from ti_schema import PARTIAL_REASON, SUBCLASS_REASON, sharded_path

# Looked up, never imported: importing torch.distributed.tensor costs about 0.4 s and 40 MB
# (sympy, symbolic shapes) in every process, and a DTensor can only exist once whoever made it
# (FSDP2, tensor parallelism, the user) has imported that module.
_DTENSOR_MODULE = "torch.distributed.tensor"

_Tensor = torch.Tensor
_SUFFIXES: dict[tuple[int, tuple[object, ...]], tuple[Any, str]] = {}
"""(id of the mesh, placements) -> (the mesh, the path suffix): a suffix is built once (the
mesh is held, so its id is not reused while cached)."""
_MAX_SUFFIXES = 64


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (each rank holds a local part, e.g. FSDP2's shards)."""
    module = sys.modules.get(_DTENSOR_MODULE)
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``tensor``: a DTensor's local part, else the tensor itself;
    detached."""
    if is_sharded(tensor):
        # without autograd: a tenth of the cost of to_local() on a tensor that requires grad,
        # and of a DTensor's own detach() (a dispatch through its sharding propagation)
        with torch.no_grad():
            tensor = tensor.to_local()  # type: ignore[attr-defined]
    return tensor.detach()


def placements_suffix(tensor: torch.Tensor) -> str:
    """What a DTensor's ``tensor_path`` adds to its position: ``@`` and its placements, and
    ``#`` with its mesh's ranks when the mesh does not span the job (``ti_schema.placements``)."""
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    placements: tuple[object, ...] = tuple(tensor.placements)  # type: ignore[attr-defined]
    key = (id(mesh), placements)
    cached = _SUFFIXES.get(key)
    if cached is not None and cached[0] is mesh:
        return cached[1]
    ranks: list[int] = [int(r) for r in mesh.mesh.flatten().tolist()]
    spans = (
        not torch.distributed.is_available()
        or not torch.distributed.is_initialized()
        or len(ranks) == torch.distributed.get_world_size()
    )
    suffix = sharded_path("", placements, None if spans else ranks)
    if len(_SUFFIXES) >= _MAX_SUFFIXES:  # meshes made again and again: keep none alive
        _SUFFIXES.clear()
    _SUFFIXES[key] = (mesh, suffix)
    return suffix


def parameter_path(name: str, param: torch.Tensor) -> str:
    """The ``tensor_path`` of a parameter: its name in the module; a DTensor adds ``@`` and its
    placements, one per mesh dimension as DTensor prints them (``weight@S(0)``), and its mesh's
    ranks when the mesh does not span the job."""
    if not is_sharded(param):
        return name
    return name + placements_suffix(param)


def leaf_path(path: str, tensor: torch.Tensor) -> str:
    """The ``tensor_path`` of an output tensor at pytree position ``path``: a DTensor adds its
    placements (:func:`placements_suffix`)."""
    if type(tensor) is _Tensor or not is_sharded(tensor):
        return path
    return path + placements_suffix(tensor)


def measurable(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """The plain tensor whose entries are ``tensor``'s measured entries on this rank, and None;
    or ``tensor`` detached (a DTensor's local part) and why it is not measured.

    - a DTensor: its local part (``to_local()``); a ``Partial`` one is not measured
      (``ti_schema.PARTIAL_REASON``): its local part is a summand, not values of the tensor;
    - a nested tensor: every entry of its components, flattened (a jagged one's ``values()``);
    - a subclass that does not override ``__torch_dispatch__`` (its entries live in its own
      storage): itself as a plain tensor;
    - a wrapper subclass holding exactly one plain tensor of its shape and dtype (its
      ``__tensor_flatten__``): that tensor;
    - any other subclass (a wrapper such as a float8 training tensor: data and scale): not
      measured, the reason naming its type (``ti_schema.SUBCLASS_REASON``).
    """
    if is_sharded(tensor):
        local = local_tensor(tensor)
        placements: Sequence[Any] = tensor.placements  # type: ignore[attr-defined]
        if any(p.is_partial() for p in placements):
            names = ",".join(str(p) for p in placements)
            return local, PARTIAL_REASON.format(placements=names)
        return local, None
    t = tensor.detach()
    if type(t) is _Tensor and not t.is_nested:
        return t, None
    if t.is_nested:
        if t.layout == torch.jagged:
            return t.values().detach(), None
        parts = [part.reshape(-1) for part in t.unbind()]
        return (torch.cat(parts) if parts else t.new_empty(0)), None
    kind = type(t)
    if not any("__torch_dispatch__" in vars(c) for c in kind.__mro__ if c is not _Tensor):
        return t.as_subclass(_Tensor), None
    inner = _pass_through(t)
    if inner is not None:
        return inner, None
    return t, SUBCLASS_REASON.format(type=f"{kind.__module__}.{kind.__qualname__}")


def _pass_through(t: torch.Tensor) -> torch.Tensor | None:
    """The one plain tensor a traceable wrapper subclass holds (``__tensor_flatten__`` names
    exactly one inner tensor, of the wrapper's shape and dtype: e.g. torchao's
    ``WeightWithDynamicFloat8CastTensor``, a float8 training weight kept in high precision),
    detached; None for any other (several inner tensors, as a float8 tensor's data and scale,
    or another shape or dtype: an encoding ti-core cannot read)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if not callable(flatten):
        return None
    try:
        names = flatten()[0]
    except Exception:
        return None
    if len(names) != 1:
        return None
    inner = getattr(t, names[0], None)
    if not isinstance(inner, _Tensor):
        return None
    inner = inner.detach()  # a Parameter's (torchao keeps one) is plain
    if type(inner) is not _Tensor or inner.shape != t.shape or inner.dtype != t.dtype:
        return None
    return inner


def shape_of(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s shape as integers; () where one is not (a jagged dim)."""
    try:
        return tuple(int(s) for s in tensor.shape)
    except (TypeError, RuntimeError, ValueError):
        return ()


__all__ = [
    "is_sharded",
    "leaf_path",
    "local_tensor",
    "measurable",
    "parameter_path",
    "placements_suffix",
    "shape_of",
]
