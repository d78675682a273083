"""Aligned sampling on a real 4-process DDP job (gloo on CPU, ``aligned_job.py`` beside this
file): with the default timed sampler and a short interval, ranks that attach seconds apart and
one rank slower per step (the leader) sample the same root forwards; a store that raises falls
back to each rank's own clock with one warning, and the job finishes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ti_dist import scan_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

JOB = Path(__file__).with_name("aligned_job.py")
JOB_TIMEOUT_S = 90
WORLD = 4
LEADER = WORLD - 1  # it attaches first (start_gap) and claims the lead; it is also the slow one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One job, two phases: ``aligned`` (the process group's store) and ``raising``."""
    root = tmp_path_factory.mktemp("aligned")
    (root / "side").mkdir()
    phases: list[dict[str, Any]] = [
        {
            "name": "aligned",
            "out": str(root / "aligned"),
            "interval": 0.2,
            "steps": 60,
            "start_gap": 1.0,
            "slow_rank": LEADER,
            "slow_seconds": 0.03,
        },
        {
            "name": "raising",
            "out": str(root / "raising"),
            "interval": 0.2,
            "steps": 20,
            "store": "raising",
        },
    ]
    cfg = {"world": WORLD, "port": _free_port(), "side": str(root / "side"), "phases": phases}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = root / "job.log"
    with log.open("w") as out:
        try:
            proc = subprocess.run(
                [sys.executable, str(JOB), json.dumps(cfg)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=JOB_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"aligned job timed out:\n{log.read_text(errors='replace')[-6000:]}")
    assert proc.returncode == 0, log.read_text(errors="replace")[-6000:]
    return root


def _side(job: Path, phase: str) -> list[dict[str, Any]]:
    return [json.loads((job / "side" / f"{phase}-rank{r}.json").read_text()) for r in range(WORLD)]


def _sampled(directory: Path) -> dict[int, list[int]]:
    steps = (
        scan_ranks(directory)
        .group_by("rank")
        .agg(pl.col("forward_index").unique().sort())
        .collect()
    )
    return dict(zip(steps["rank"].to_list(), steps["forward_index"].to_list(), strict=True))


def test_every_rank_samples_the_same_forwards(job: Path) -> None:
    sampled = _sampled(job / "aligned")
    assert sorted(sampled) == list(range(WORLD))
    assert all(sampled[r] == sampled[LEADER] for r in range(WORLD)), sampled
    forwards = sampled[LEADER]
    assert forwards[0] == 0
    assert len(forwards) >= 4, forwards  # ~2 s of steps at a 0.2 s interval
    for record in _side(job, "aligned"):
        assert record["warnings"] == []
        assert record["settings"]["sampling_alignment"] == (
            f"store: leader rank {LEADER} (key 'ti-sampling/0')"
        )
    index_md = (job / "aligned" / "rank-000" / "index.md").read_text()
    assert "sampling_alignment" in index_md


def test_a_store_that_raises_falls_back_with_one_warning(job: Path) -> None:
    sampled = _sampled(job / "raising")
    assert sorted(sampled) == list(range(WORLD))
    for rank, record in enumerate(_side(job, "raising")):
        assert len(record["warnings"]) == 1, record["warnings"]
        message = record["warnings"][0]
        assert (
            f"aligned sampling on rank {rank} fell back to this rank's own clock at attach"
            in message
        )
        assert "store unreachable" in message
        assert "need not be the same root forwards as other ranks'" in message
        assert record["settings"]["sampling_alignment"].startswith(
            "fallback: claiming the store key 'ti-sampling/1/leader' failed"
        )
        assert sampled[rank][0] == 0  # its own clock: the first forward at once
