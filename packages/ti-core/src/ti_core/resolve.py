"""Finding optional providers by name through entry points (ti-core never imports them).

``ti.sinks`` / ``directory`` is what ``output_dir=`` resolves to (ti-io); ``ti.rank_policies``
holds the named rank policies (ti-dist).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from ti_core.errors import MissingProviderError
from ti_core.ranks import RankPolicy, RankSelection, visibly_distributed

SINKS_GROUP = "ti.sinks"
RANK_POLICIES_GROUP = "ti.rank_policies"
BUILTIN_RANK_POLICY_NAMES = ("rank0", "all")
"""Names ti-dist registers; without ti-dist they mean 'rank 0 of 1' in a single process."""


def _entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=group)}


def directory_sink_factory() -> Callable[[Any], Any] | None:
    """The factory registered as ``ti.sinks`` / ``directory``, or None when ti-io is missing."""
    ep = _entry_points(SINKS_GROUP).get("directory")
    if ep is None:
        return None
    factory: Callable[[Any], Any] = ep.load()
    return factory


def missing_directory_sink(
    *, default: bool = False, with_sinks: bool = False
) -> MissingProviderError:
    """The error for an ``output_dir`` without ti-io; names both fixes."""
    if default and with_sinks:
        what = (
            "sink= adds to the run directory, and output_dir defaults to 'stats', which needs "
            "the directory sink of ti-io (not installed)"
        )
        memory = "pass output_dir=None to use only the sinks in sink="
    elif default:
        what = (
            "inject_observer writes its artifacts to output_dir='stats' by default, which needs "
            "the directory sink of ti-io (not installed)"
        )
        memory = "keep the records in memory with sink=MemorySink(), output_dir=None"
    else:
        what = "output_dir= needs the directory sink of ti-io, which is not installed"
        memory = "keep the records in memory with sink=MemorySink(), output_dir=None"
    return MissingProviderError(
        f"{what}: `pip install ti-io`, or {memory} (from ti_core import MemorySink)"
    )


class SingleProcess:
    """Core's fallback without ti-dist: rank 0 of 1, refusing a visibly distributed job."""

    def __init__(self, name: str) -> None:
        self.name = name

    def select(self) -> RankSelection:
        if visibly_distributed():
            raise MissingProviderError(
                f"rank_policy={self.name!r} in a distributed job (WORLD_SIZE > 1 or an "
                "initialized process group) needs ti-dist: `pip install ti-dist`, or pass a "
                "RankPolicy object. Refusing to let every rank write."
            )
        return RankSelection(rank=0, world_size=1, observe=True, subdir=None)

    def __repr__(self) -> str:
        return f"SingleProcess({self.name!r})"


def rank_policy(policy: str | RankPolicy) -> RankPolicy:
    """Resolve ``rank_policy=``: an object with ``select()`` wins, a name is looked up."""
    if not isinstance(policy, str):
        if not isinstance(policy, type) and callable(getattr(policy, "select", None)):
            return policy
        raise TypeError(
            f"rank_policy= must be a name ({', '.join(BUILTIN_RANK_POLICY_NAMES)}) or an object "
            f"with select() -> RankSelection, got {policy!r}"
        )
    eps = _entry_points(RANK_POLICIES_GROUP)
    ep = eps.get(policy)
    if ep is not None:
        loaded = ep.load()
        instance = loaded() if isinstance(loaded, type) else loaded
        if not callable(getattr(instance, "select", None)):
            raise TypeError(f"rank policy {policy!r} from {ep.value} has no select() method")
        return instance  # type: ignore[no-any-return]
    if policy in BUILTIN_RANK_POLICY_NAMES:
        return SingleProcess(policy)
    known = sorted(set(BUILTIN_RANK_POLICY_NAMES) | set(eps))
    raise ValueError(
        f"rank_policy={policy!r} is not known; use one of {', '.join(known)} or pass a "
        "RankPolicy object"
    )


def select_rank(policy: RankPolicy) -> RankSelection:
    """Call ``policy.select()`` and check what it returned."""
    selection = policy.select()
    if not isinstance(selection, RankSelection):
        raise TypeError(
            f"rank policy {policy!r}.select() must return a RankSelection, got {selection!r}"
        )
    return selection
