"""Rank policies: what each rank is told, validation, and the entry-point registration."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from ti_dist import AllRanks, Rank0Only, RankDetectionError, Ranks, rank_subdir
from ti_schema.ranks import RankPolicy, RankSelection


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_RANK", str(rank % 2))


def test_rank_subdir_is_zero_padded() -> None:
    assert [rank_subdir(r) for r in (0, 7, 42, 1234)] == [
        "rank-000",
        "rank-007",
        "rank-042",
        "rank-1234",
    ]


def test_rank0_only_single_process_observes_in_place() -> None:
    assert Rank0Only().select() == RankSelection(rank=0, world_size=1, observe=True, subdir=None)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_rank0_only_in_a_job(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    _as_rank(monkeypatch, rank, 4)
    assert Rank0Only().select() == RankSelection(rank, 4, observe=rank == 0, subdir=None)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_all_ranks_each_into_its_own_subdir(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    _as_rank(monkeypatch, rank, 4)
    assert AllRanks().select() == RankSelection(rank, 4, True, f"rank-00{rank}")


def test_all_ranks_single_process_keeps_the_rank_layout() -> None:
    assert AllRanks().select() == RankSelection(0, 1, True, "rank-000")


@pytest.mark.parametrize(("rank", "observes"), [(0, False), (1, True), (2, False), (3, True)])
def test_explicit_ranks(monkeypatch: pytest.MonkeyPatch, rank: int, observes: bool) -> None:
    _as_rank(monkeypatch, rank, 4)
    expected = RankSelection(rank, 4, observes, f"rank-00{rank}" if observes else None)
    assert Ranks([3, 1, 1]).select() == expected


def test_explicit_ranks_outside_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match=r"ranks=\[1, 2, 5\] names ranks \[2, 5\].*world size 2"):
        Ranks({1, 2, 5}).select()


@pytest.mark.parametrize(
    ("ranks", "error", "match"),
    [
        ([], ValueError, "ranks must name at least one global rank"),
        ([0, -1], ValueError, "ranks must be >= 0"),
        ([0, 1.0], TypeError, "ranks must hold ints.*float"),
        ([True], TypeError, "ranks must hold ints.*bool"),
        ("01", TypeError, "ranks must be an iterable of ints"),
        (3, TypeError, "ranks must be an iterable of ints"),
    ],
)
def test_explicit_ranks_validation(ranks: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Ranks(ranks)  # type: ignore[arg-type]


def test_policy_objects_compare_and_print() -> None:
    assert Ranks((2, 0)) == Ranks([0, 2])
    assert Ranks([0, 2]).ranks == frozenset({0, 2})
    assert repr(Ranks({2, 0})) == "Ranks([0, 2])"
    assert Rank0Only() == Rank0Only() != AllRanks()
    assert repr(AllRanks()) == "AllRanks()"
    assert len({Rank0Only(), Rank0Only(), AllRanks(), Ranks([1]), Ranks([1])}) == 3


def test_policies_satisfy_the_core_protocol() -> None:
    # ti-core reads policies through this protocol (ti_core.RankPolicy is ti-schema's)
    for policy in (Rank0Only(), AllRanks(), Ranks([0])):
        assert isinstance(policy, RankPolicy)


def test_detection_errors_reach_select(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for policy in (Rank0Only(), AllRanks(), Ranks([0])):
        with pytest.raises(RankDetectionError, match="RANK='x'"):
            policy.select()


def test_entry_points_name_the_policies() -> None:
    found = {ep.name: ep for ep in entry_points(group="ti.rank_policies")}
    assert {"rank0", "all"} <= set(found)
    assert found["rank0"].load() is Rank0Only
    assert found["all"].load() is AllRanks
    for name in ("rank0", "all"):
        policy = found[name].load()()
        assert isinstance(policy, RankPolicy)
        assert policy.select().observe


def test_resolving_a_policy_does_not_import_polars() -> None:
    # Every rank loads the policy; only readers need Polars, so training ranks skip its import.
    code = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        "policy = {ep.name: ep for ep in entry_points(group='ti.rank_policies')}['rank0'].load()\n"
        "policy().select()\n"
        "assert 'polars' not in sys.modules, 'polars was imported'\n"
        "import ti_dist\n"
        "assert ti_dist.scan_ranks.__module__ == 'ti_dist.reading'\n"
        "assert 'polars' in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_unknown_attribute() -> None:
    import ti_dist

    with pytest.raises(AttributeError, match="no attribute 'scan_rank'"):
        ti_dist.scan_rank  # noqa: B018
