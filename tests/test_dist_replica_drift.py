"""Replica drift on a real 4-process DDP job (gloo on CPU, ``drift_job.py`` beside this file):
the parameter signal on every rank, the same forwards sampled on every rank, and one rank's
parameter perturbed after a step. ``replica_drift`` / ``first_drift`` and ``ti drift`` must name
that rank, that parameter and the first sampled step at or after the perturbation; without it,
every rank agrees exactly at every sampled step."""

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

JOB = Path(__file__).with_name("drift_job.py")
JOB_TIMEOUT_S = 120
WORLD = 4
STEPS = 8
SAMPLER = "every:2"  # aligned by construction; the default timed sampler once it is aligned
SAMPLED = [0, 2, 4, 6]
PERTURB_RANK = 2
PERTURB_BEFORE = 3  # after step 2's optimizer step: forward 3 (unsampled) is the first to see it
FIRST_SAMPLED_AFTER = 4
PARAMETERS = {"0.weight", "0.bias", "2.weight", "2.bias"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One job, two phases: ``agree`` (no perturbation) and ``drift`` (rank 2 perturbed)."""
    root = tmp_path_factory.mktemp("drift")
    (root / "side").mkdir()
    phases: list[dict[str, Any]] = [
        {"name": "agree", "out": str(root / "agree")},
        {
            "name": "drift",
            "out": str(root / "drift"),
            "perturb_rank": PERTURB_RANK,
            "perturb_before": PERTURB_BEFORE,
            "perturb_by": 1e-3,
        },
    ]
    cfg = {
        "world": WORLD,
        "steps": STEPS,
        "sampler": SAMPLER,
        "port": _free_port(),
        "side": str(root / "side"),
        "phases": phases,
    }
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
            pytest.fail(f"drift job timed out:\n{log.read_text(errors='replace')[-6000:]}")
    assert proc.returncode == 0, log.read_text(errors="replace")[-6000:]
    return root


def test_every_rank_sampled_the_same_forwards(job: Path) -> None:
    for phase in ("agree", "drift"):
        rows = scan_ranks(job / phase).filter(pl.col("signal") == "parameter")
        steps = rows.group_by("rank").agg(pl.col("forward_index").unique().sort()).collect()
        assert sorted(steps["rank"]) == list(range(WORLD))
        assert steps["forward_index"].to_list() == [SAMPLED] * WORLD


def test_unperturbed_replicas_agree_exactly(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = replica_drift(job / "agree")
    assert set(table["forward_index"]) == set(SAMPLED)
    assert {f"{layer}.{path}" for layer, path in table.select("layer", "tensor_path").rows()} == (
        PARAMETERS
    )
    assert table["agree"].all()
    assert first_drift(table) is None
    assert main(["drift", str(job / "agree")]) == 0
    out = capsys.readouterr().out
    assert "all 4 ranks agree exactly on all 4 parameters at all 4 steps" in out


def test_a_perturbed_replica_is_named(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    drift = first_drift(job / "drift")
    assert drift is not None
    assert (drift.forward_index, drift.parameter) == (FIRST_SAMPLED_AFTER, "0.weight")
    assert drift.differing_ranks == (PERTURB_RANK,)
    assert drift.parameters_differing == 1  # DDP's all-reduce keeps the others identical
    assert "mean" in drift.differing_metrics
    # The means the ranks recorded differ by the perturbation's share of the mean (float64).
    side = job / "side"
    weights = {r: np.load(side / f"drift-rank{r}-f{FIRST_SAMPLED_AFTER}.npy") for r in range(WORLD)}
    expected = weights[PERTURB_RANK].mean() - weights[0].mean()
    recorded = drift.values["mean"][PERTURB_RANK] - drift.values["mean"][0]  # type: ignore[operator]
    assert recorded == pytest.approx(expected, rel=1e-3)
    assert recorded == pytest.approx(1e-3 / weights[0].size, rel=1e-2)
    for rank in range(WORLD):
        assert drift.values["mean"][rank] == pytest.approx(weights[rank].mean(), rel=1e-6)

    assert main(["drift", str(job / "drift")]) == 1
    out = capsys.readouterr().out
    assert f"replicas differ at forward_index {FIRST_SAMPLED_AFTER}: parameter 0.weight" in out
    assert "rank 2 differs from ranks 0, 1, 3" in out
