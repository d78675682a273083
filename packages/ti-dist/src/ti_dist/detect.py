"""Which rank this process is: the process group first, then the launcher's environment.

Sources, in order of authority:

1. an initialized default ``torch.distributed`` process group;
2. the launcher environment ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (torchrun and most launchers);
3. SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (one process per task, ``srun``);
4. otherwise a single process: rank 0 of 1.

Every source present must agree with the others; a disagreement is an error naming the sources
and their values, because picking one silently could make two processes write as the same rank.
When torchrun started this process (``TORCHELASTIC_RUN_ID`` is set) the SLURM variables describe
torchrun's agents, not its workers, and are not consulted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

Source = Literal["process_group", "launcher_env", "slurm_env", "single_process"]

SOURCE_LABELS: Final[dict[str, str]] = {
    "process_group": "the initialized torch.distributed process group",
    "launcher_env": "the launcher environment (RANK/WORLD_SIZE/LOCAL_RANK, e.g. torchrun)",
    "slurm_env": "the SLURM environment (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID)",
    "single_process": "no distributed job detected (single process)",
}

_TORCHELASTIC_MARKER: Final[str] = "TORCHELASTIC_RUN_ID"


class RankDetectionError(RuntimeError):
    """The rank sources disagree or hold malformed values."""


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job and where that fact came from."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    world_size: int
    local_rank: int
    """Rank on this machine (``LOCAL_RANK``/``SLURM_LOCALID``); the global rank when unknown."""
    source: Source
    """The most authoritative source that was present (see :data:`SOURCE_LABELS`)."""


@dataclass(frozen=True)
class _Reading:
    source: Source
    rank: int
    world_size: int
    local_rank: int | None
    described_as: str
    """How the values appeared, e.g. ``RANK=1, WORLD_SIZE=4`` (used in error messages)."""


def _parse_int(env: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise RankDetectionError(
            f"environment variable {name}={raw!r} is not an integer; the launcher sets it to a "
            f"whole number >= {minimum}: unset it or fix the launch command"
        ) from None
    if value < minimum:
        raise RankDetectionError(
            f"environment variable {name}={value} must be >= {minimum}; unset it or fix the "
            "launch command"
        )
    return value


def _check_rank_in_world(
    rank: int, world_size: int, rank_name: str, world_name: str, what: str
) -> None:
    if rank >= world_size:
        raise RankDetectionError(
            f"{what}: {rank_name}={rank} is not below {world_name}={world_size}; "
            "a rank must be in 0..world_size-1"
        )


def _launcher_reading(env: Mapping[str, str]) -> _Reading | None:
    rank = _parse_int(env, "RANK", minimum=0)
    world = _parse_int(env, "WORLD_SIZE", minimum=1)
    local = _parse_int(env, "LOCAL_RANK", minimum=0)
    if rank is None and world is None:
        return None
    if world is None:
        raise RankDetectionError(
            f"environment variable RANK={rank} is set but WORLD_SIZE is not; set both "
            "(torchrun sets both) or neither"
        )
    if rank is None:
        if world == 1:
            rank = 0
        else:
            raise RankDetectionError(
                f"environment variable WORLD_SIZE={world} is set but RANK is not; set both "
                "(torchrun sets both) or neither"
            )
    _check_rank_in_world(rank, world, "RANK", "WORLD_SIZE", "launcher environment")
    return _Reading("launcher_env", rank, world, local, f"RANK={rank}, WORLD_SIZE={world}")


def _slurm_reading(env: Mapping[str, str]) -> _Reading | None:
    if env.get(_TORCHELASTIC_MARKER):
        return None
    rank = _parse_int(env, "SLURM_PROCID", minimum=0)
    if rank is None:
        return None
    world_name = "SLURM_NTASKS" if env.get("SLURM_NTASKS") else "SLURM_NPROCS"
    world = _parse_int(env, world_name, minimum=1)
    if world is None:
        raise RankDetectionError(
            f"environment variable SLURM_PROCID={rank} is set but SLURM_NTASKS is not; "
            "launch with srun (which sets both) or unset SLURM_PROCID"
        )
    local = _parse_int(env, "SLURM_LOCALID", minimum=0)
    _check_rank_in_world(rank, world, "SLURM_PROCID", world_name, "SLURM environment")
    return _Reading("slurm_env", rank, world, local, f"SLURM_PROCID={rank}, {world_name}={world}")


def _process_group_reading() -> _Reading | None:
    # torch is not a dependency (the readers run without it): a process without torch has
    # no process group.
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    world = dist.get_world_size()
    return _Reading(
        "process_group", rank, world, None, f"get_rank()={rank}, get_world_size()={world}"
    )


def _disagreement(first: _Reading, other: _Reading) -> str:
    return (
        f"rank sources disagree: {SOURCE_LABELS[first.source]} says {first.described_as}, but "
        f"{SOURCE_LABELS[other.source]} says {other.described_as}. Each process must have one "
        "rank; fix the launch (for example stale variables exported in the shell or job script) "
        "so that they agree, or unset the stale ones"
    )


def detect_rank(environ: Mapping[str, str] | None = None) -> RankInfo:
    """Return this process's rank, world size and local rank.

    ``environ`` defaults to ``os.environ``. Raises :class:`RankDetectionError` when the sources
    present disagree or an environment variable is malformed (the message names it).
    """
    env = os.environ if environ is None else environ
    readings = [
        reading
        for reading in (_process_group_reading(), _launcher_reading(env), _slurm_reading(env))
        if reading is not None
    ]
    if not readings:
        return RankInfo(rank=0, world_size=1, local_rank=0, source="single_process")
    first = readings[0]
    for other in readings[1:]:
        if (other.rank, other.world_size) != (first.rank, first.world_size):
            raise RankDetectionError(_disagreement(first, other))
    local_ranks = {r.source: r.local_rank for r in readings if r.local_rank is not None}
    if len(set(local_ranks.values())) > 1:
        detail = ", ".join(
            f"{'LOCAL_RANK' if src == 'launcher_env' else 'SLURM_LOCALID'}={value}"
            for src, value in local_ranks.items()
        )
        raise RankDetectionError(
            f"rank sources disagree on the local rank: {detail}; fix the launch so that they "
            "agree, or unset the stale variable"
        )
    local_rank = next(iter(local_ranks.values()), first.rank)
    if local_rank >= first.world_size:
        raise RankDetectionError(
            f"local rank {local_rank} is not below the world size {first.world_size}; "
            "fix LOCAL_RANK/SLURM_LOCALID"
        )
    return RankInfo(
        rank=first.rank, world_size=first.world_size, local_rank=local_rank, source=first.source
    )
