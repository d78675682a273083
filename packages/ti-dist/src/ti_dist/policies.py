"""Rank policies: which processes of a distributed job observe, and where each one writes.

A policy is asked once, when the observer is attached (``RankPolicy.select``). It only reads this
process's rank; it never communicates with other ranks, so it adds no barrier or collective to
the user's job. Ranks that observe write into their own directory (or, for ``Rank0Only``, rank 0
alone writes into ``output_dir``), so no two ranks share a file, lock or writer.
"""

from __future__ import annotations

from collections.abc import Iterable

from ti_dist.detect import detect_rank
from ti_schema.layout import rank_dir_name
from ti_schema.ranks import RankSelection


def rank_subdir(rank: int) -> str:
    """The rank-private directory name for ``rank``: ``rank-000``, ``rank-001``, ...
    (:func:`ti_schema.layout.rank_dir_name`)."""
    return rank_dir_name(rank)


class Rank0Only:
    """Only global rank 0 observes, writing into ``output_dir`` itself (the default policy).

    Other ranks attach nothing: no hooks, no files, no cost.
    """

    def select(self) -> RankSelection:
        """Observe on rank 0 only."""
        info = detect_rank()
        return RankSelection(
            rank=info.rank, world_size=info.world_size, observe=info.rank == 0, subdir=None
        )

    def __repr__(self) -> str:
        return "Rank0Only()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rank0Only)

    def __hash__(self) -> int:
        return hash(Rank0Only)


class AllRanks:
    """Every rank observes and writes its full artifact set into ``output_dir/rank-NNN/``."""

    def select(self) -> RankSelection:
        """Observe on every rank, each into its own ``rank-NNN`` subdirectory."""
        info = detect_rank()
        return RankSelection(
            rank=info.rank,
            world_size=info.world_size,
            observe=True,
            subdir=rank_subdir(info.rank),
        )

    def __repr__(self) -> str:
        return "AllRanks()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AllRanks)

    def __hash__(self) -> int:
        return hash(AllRanks)


class Ranks:
    """An explicit set of global ranks observes, each into ``output_dir/rank-NNN/``.

    ``Ranks([0, 3])`` observes on ranks 0 and 3 of the job; every other rank attaches nothing.
    Listing a rank the job does not have is an error at attach time, on every rank alike.
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise TypeError(
                f"ranks must be an iterable of ints (e.g. Ranks([0, 3])), got {ranks!r}"
            )
        chosen: set[int] = set()
        for value in ranks:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"ranks must hold ints (global ranks), got {value!r} of type "
                    f"{type(value).__name__}"
                )
            if value < 0:
                raise ValueError(f"ranks must be >= 0 (global ranks), got {value}")
            chosen.add(value)
        if not chosen:
            raise ValueError(
                "ranks must name at least one global rank, e.g. Ranks([0]); to observe nothing, "
                "do not attach an observer"
            )
        self._ranks: frozenset[int] = frozenset(chosen)

    @property
    def ranks(self) -> frozenset[int]:
        """The global ranks that observe."""
        return self._ranks

    def select(self) -> RankSelection:
        """Observe when this process's global rank is in the set."""
        info = detect_rank()
        outside = sorted(r for r in self._ranks if r >= info.world_size)
        if outside:
            raise ValueError(
                f"ranks={sorted(self._ranks)} names ranks {outside} but this job has world size "
                f"{info.world_size} (ranks 0..{info.world_size - 1}); list only existing ranks"
            )
        observe = info.rank in self._ranks
        return RankSelection(
            rank=info.rank,
            world_size=info.world_size,
            observe=observe,
            subdir=rank_subdir(info.rank) if observe else None,
        )

    def __repr__(self) -> str:
        return f"Ranks({sorted(self._ranks)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ranks) and other._ranks == self._ranks

    def __hash__(self) -> int:
        return hash((Ranks, self._ranks))
