"""The ``tensor_path`` of a tensor one rank holds a part of (a DTensor): its placements, and
the ranks its part is combined with.

A DTensor's rows measure the part this rank holds (``to_local()``); the path says which part,
after the position of the tensor (a parameter's name, an output's pytree position):

    <position>@<placement>[,<placement>...][#<rank>,<rank>...]

- one placement per dimension of the DTensor's device mesh, as DTensor prints them: ``S(d)``
  (sharded on dim ``d``), ``R`` (replicated), ``P(sum)`` (partial: each rank holds a summand of
  every entry, not values of the tensor; its rows are null with :data:`PARTIAL_REASON`),
  ``_S(d, k)`` (strided shard);
- ``#`` and the global ranks of the device mesh (in mesh order) when the mesh does not span
  every rank of the job: a tensor-parallel submesh of a 2D mesh (``@S(1)#0,1`` on ranks 0 and
  1, ``@S(1)#2,3`` on ranks 2 and 3, which hold another batch). Without it the mesh is the
  whole job.

Contract 1.5 (outputs and output gradients; parameters since 1.2 without ``#``). Shards of one
tensor combine exactly where the metric declares a rule (:mod:`ti_schema.metrics`) and the
placements are one ``S(d)``: ``ti_dist.combine_shards``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

_PLACEMENT: Final[str] = r"(?:S\(\d+\)|R|P\([a-z_]+\)|_S\(\d+, ?\d+\))"
SHARDED_PATH: Final[str] = (
    rf"^(?P<position>.*)@(?P<placements>{_PLACEMENT}(?:,{_PLACEMENT})*)"
    r"(?:#(?P<ranks>\d+(?:,\d+)*))?$"
)
"""A ``tensor_path`` of a DTensor part (module docstring); groups ``position``,
``placements`` and ``ranks``."""

PARTIAL_REASON: Final[str] = (
    "a partial DTensor ({placements}): this rank holds a summand of each entry, not values of "
    "the tensor (measure it after its reduction, e.g. the next module's output)"
)
"""Why the rows of a ``Partial`` DTensor are null."""

SUBCLASS_REASON: Final[str] = (
    "a tensor subclass ({type}) without a plain representation: not measured"
)
"""Why the rows of a tensor subclass ti-core cannot read exactly are null."""

PLACEMENT_MISMATCH_REASON: Final[str] = (
    "the gradient's placements ({gradient}) differ from those of the output it answers "
    "({output}, in tensor_path): not measured"
)
"""Why a DTensor gradient laid out unlike its output is not measured (its path would lie)."""

_PARSE: Final = re.compile(SHARDED_PATH)


@dataclass(frozen=True)
class ShardedPath:
    """A parsed ``tensor_path`` of a DTensor part."""

    position: str
    """The tensor's position: a parameter's name, an output's pytree position ('' if bare)."""
    placements: tuple[str, ...]
    """One per mesh dimension, as DTensor prints them."""
    ranks: tuple[int, ...] | None
    """The device mesh's global ranks, when it does not span the job (None: every rank)."""

    @property
    def shard_dim(self) -> int | None:
        """The sharded dim when the tensor is sharded on one dim of a one-dimensional mesh (the
        layout whose parts combine exactly), else None."""
        if len(self.placements) != 1:
            return None
        found = re.fullmatch(r"S\((\d+)\)", self.placements[0])
        return int(found.group(1)) if found else None


def parse_sharded_path(path: str | None) -> ShardedPath | None:
    """The parts of a DTensor part's ``tensor_path``; None for a whole tensor's."""
    found = _PARSE.match(path or "")
    if found is None:
        return None
    ranks = found.group("ranks")
    return ShardedPath(
        found.group("position"),
        tuple(re.findall(_PLACEMENT, found.group("placements"))),
        tuple(int(r) for r in ranks.split(",")) if ranks else None,
    )


def sharded_path(
    position: str, placements: Sequence[object], ranks: Sequence[int] | None = None
) -> str:
    """The ``tensor_path`` of a DTensor part at ``position`` (module docstring); ``ranks``:
    the mesh's ranks, given only when the mesh does not span the job."""
    path = f"{position}@{','.join(str(p) for p in placements)}"
    return f"{path}#{','.join(str(r) for r in ranks)}" if ranks else path


__all__ = [
    "PARTIAL_REASON",
    "PLACEMENT_MISMATCH_REASON",
    "SHARDED_PATH",
    "SUBCLASS_REASON",
    "ShardedPath",
    "parse_sharded_path",
    "sharded_path",
]
