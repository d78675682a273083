"""Aligned sampling and replica drift on a real 4-process DDP job (gloo on CPU,
``aligned_job.py`` beside this file), with the default timed sampler and a short interval:

- ranks that attach seconds apart and one rank slower per step (the leader) sample the same
  root forwards;
- the parameter signal on: unperturbed replicas agree exactly at every sampled step, and with
  one rank's parameter perturbed before a step, ``replica_drift`` / ``first_drift`` and
  ``ti drift`` name that rank, that parameter and the first sampled step at or after it;
- a store that raises falls back to each rank's own clock with one warning, and the job
  finishes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from ti_dist import first_drift, replica_drift, scan_ranks
from ti_io.cli import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

JOB = Path(__file__).with_name("aligned_job.py")
JOB_TIMEOUT_S = 120
WORLD = 4
LEADER = WORLD - 1  # it attaches first (start_gap) and claims the lead; it is also the slow one
PERTURB_RANK = 2
PERTURB_STEP = 12  # before forward 12 (after forward 11's optimizer step)
PARAMETERS = {"0.weight", "0.bias", "2.weight", "2.bias"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One job, three phases: ``aligned`` (the process group's store), ``drift`` (the same,
    rank 2's replica perturbed) and ``raising`` (a store that raises)."""
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
            "signals": ["output", "output_gradient", "parameter"],
        },
        {
            "name": "drift",
            "out": str(root / "drift"),
            "interval": 0.2,
            "steps": 50,
            "slow_rank": LEADER,
            "slow_seconds": 0.03,
            "perturb_rank": PERTURB_RANK,
            "perturb_step": PERTURB_STEP,
            "perturb_by": 1e-3,
            "signals": ["parameter"],
            "save_weights": True,
        },
        {
            "name": "raising",  # the job's third attachment: key ti-sampling/2
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


def _aligned_forwards(directory: Path) -> list[int]:
    """The root forwards every rank sampled: the same on each (asserted), from forward 0."""
    sampled = _sampled(directory)
    assert sorted(sampled) == list(range(WORLD))
    assert all(sampled[r] == sampled[LEADER] for r in range(WORLD)), sampled
    forwards: list[int] = sampled[LEADER]
    assert forwards[0] == 0
    assert len(forwards) >= 4, forwards  # ~1.5-2 s of steps at a 0.2 s interval
    return forwards


def test_every_rank_samples_the_same_forwards(job: Path) -> None:
    _aligned_forwards(job / "aligned")
    for record in _side(job, "aligned"):
        assert record["warnings"] == []
        assert record["settings"]["sampling_alignment"] == (
            f"store: leader rank {LEADER} (key 'ti-sampling/0')"
        )
    index_md = (job / "aligned" / "rank-000" / "index.md").read_text()
    assert "sampling_alignment" in index_md


def test_unperturbed_replicas_agree_exactly(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    forwards = _aligned_forwards(job / "aligned")
    table = replica_drift(job / "aligned")
    assert sorted(set(table["forward_index"])) == forwards
    assert {f"{layer}.{path}" for layer, path in table.select("layer", "tensor_path").rows()} == (
        PARAMETERS
    )
    assert table["agree"].all()
    assert first_drift(table) is None
    assert main(["drift", str(job / "aligned")]) == 0
    out = capsys.readouterr().out
    assert f"all 4 ranks agree exactly on all 4 parameters at all {len(forwards)} steps" in out


def test_a_perturbed_replica_is_named(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    forwards = _aligned_forwards(job / "drift")  # the same default timed sampler, aligned
    first = min(f for f in forwards if f >= PERTURB_STEP)
    drift = first_drift(job / "drift")
    assert drift is not None
    assert (drift.forward_index, drift.parameter) == (first, "0.weight")
    assert drift.differing_ranks == (PERTURB_RANK,)
    assert drift.parameters_differing == 1  # DDP's all-reduce keeps the others identical
    assert "mean" in drift.differing_metrics
    # The means the ranks recorded differ by the perturbation's share of the mean (float64).
    side = job / "side"
    weights = {r: np.load(side / f"drift-rank{r}-f{first}.npy") for r in range(WORLD)}
    expected = weights[PERTURB_RANK].mean() - weights[0].mean()
    recorded = drift.values["mean"][PERTURB_RANK] - drift.values["mean"][0]  # type: ignore[operator]
    assert recorded == pytest.approx(expected, rel=1e-3)
    assert recorded == pytest.approx(1e-3 / weights[0].size, rel=1e-2)
    for rank in range(WORLD):
        assert drift.values["mean"][rank] == pytest.approx(weights[rank].mean(), rel=1e-6)
    # before the perturbation every sampled step agrees
    table = replica_drift(job / "drift")
    assert table.filter(table["forward_index"] < PERTURB_STEP)["agree"].all()

    assert main(["drift", str(job / "drift")]) == 1
    out = capsys.readouterr().out
    assert f"replicas differ at forward_index {first}: parameter 0.weight" in out
    assert "rank 2 differs from ranks 0, 1, 3" in out


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
            "fallback: claiming the store key 'ti-sampling/2/leader' failed"
        )
        assert sampled[rank][0] == 0  # its own clock: the first forward at once
