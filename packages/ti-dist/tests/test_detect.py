"""detect_rank against real environments, without torch (the gloo process-group cases are in
the repository's tests/test_dist_process_groups.py, which has torch)."""

from __future__ import annotations

import sys

import pytest

from ti_dist import RankDetectionError, RankInfo, detect_rank

RANK_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_LOCALID",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RANK_VARS:
        monkeypatch.delenv(name, raising=False)


def test_single_process_without_any_source() -> None:
    assert detect_rank() == RankInfo(rank=0, world_size=1, local_rank=0, source="single_process")


def test_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert detect_rank() == RankInfo(rank=5, world_size=8, local_rank=1, source="launcher_env")


def test_local_rank_defaults_to_global_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert detect_rank().local_rank == 2


def test_world_size_one_alone_is_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert detect_rank() == RankInfo(0, 1, 0, "launcher_env")


def test_slurm_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert detect_rank() == RankInfo(rank=3, world_size=4, local_rank=1, source="slurm_env")


def test_slurm_nprocs_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NPROCS", "2")
    assert detect_rank() == RankInfo(1, 2, 1, "slurm_env")


def test_agreeing_torchrun_and_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    assert detect_rank() == RankInfo(1, 2, 0, "launcher_env")


def test_torchrun_and_slurm_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(RankDetectionError) as err:
        detect_rank()
    message = str(err.value)
    assert "RANK=1, WORLD_SIZE=2" in message
    assert "SLURM_PROCID=0, SLURM_NTASKS=2" in message
    assert "launcher environment" in message
    assert "SLURM environment" in message


def test_local_ranks_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RankDetectionError, match=r"LOCAL_RANK=1, SLURM_LOCALID=0"):
        detect_rank()


def test_slurm_ignored_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    # srun starts one torchrun agent per node; SLURM_PROCID is the node, RANK the worker.
    for name, value in {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "TORCHELASTIC_RUN_ID": "job-17",
    }.items():
        monkeypatch.setenv(name, value)
    assert detect_rank() == RankInfo(6, 8, 2, "launcher_env")


@pytest.mark.parametrize(
    ("name", "value", "others"),
    [
        ("RANK", "one", {"WORLD_SIZE": "2"}),
        ("WORLD_SIZE", "2.0", {"RANK": "0"}),
        ("LOCAL_RANK", "x", {"RANK": "0", "WORLD_SIZE": "2"}),
        ("SLURM_PROCID", "-", {"SLURM_NTASKS": "2"}),
        ("SLURM_NTASKS", "many", {"SLURM_PROCID": "0"}),
    ],
)
def test_malformed_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, others: dict[str, str]
) -> None:
    for other, other_value in others.items():
        monkeypatch.setenv(other, other_value)
    monkeypatch.setenv(name, value)
    with pytest.raises(RankDetectionError, match=rf"{name}='{value}' is not an integer"):
        detect_rank()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK=-1 must be >= 0"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 must be >= 1"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 is not below WORLD_SIZE=2"),
        ({"RANK": "1"}, r"RANK=1 is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "4"}, r"WORLD_SIZE=4 is set but RANK is not"),
        ({"SLURM_PROCID": "0"}, r"SLURM_PROCID=0 is set but SLURM_NTASKS is not"),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, r"SLURM_PROCID=4 is not below"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2"}, r"local rank 2"),
    ],
)
def test_impossible_values(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RankDetectionError, match=match):
        detect_rank()


def test_environ_argument_overrides_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect_rank({}) == RankInfo(0, 1, 0, "single_process")


def test_without_torch_there_is_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # ti-dist does not depend on torch: its absence means no process group, not an error.
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch...` raise ImportError
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    assert detect_rank({}) == RankInfo(0, 1, 0, "single_process")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect_rank() == RankInfo(1, 2, 1, "launcher_env")
