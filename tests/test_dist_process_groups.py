"""ti-dist's rank detection against a real single-process gloo group (needs torch, which
ti-dist does not depend on: its own tests run without it)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """A real one-process gloo group (rank 0 of 1), destroyed afterwards."""
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}"
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.usefixtures("gloo_group")
def test_initialized_process_group_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    assert detect_rank() == RankInfo(0, 1, 0, "process_group")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert detect_rank() == RankInfo(0, 1, 0, "process_group")


@pytest.mark.distributed
@pytest.mark.usefixtures("gloo_group")
def test_process_group_and_environment_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RankDetectionError) as err:
        detect_rank()
    message = str(err.value)
    assert "process group says get_rank()=0, get_world_size()=1" in message
    assert "RANK=1, WORLD_SIZE=2" in message


@pytest.mark.distributed
@pytest.mark.usefixtures("gloo_group")
def test_process_group_and_slurm_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(RankDetectionError, match=r"SLURM_PROCID=0, SLURM_NTASKS=4"):
        detect_rank()
