"""Tensor, sequence and 2D (FSDP2 x tensor) parallelism on real gloo jobs
(``parallel_job.py`` beside this file): DTensor outputs and output gradients measured on
each rank's part, exactly, and combined into whole-tensor statistics by
``ti_dist.combine_shards`` that equal a single-process numpy float64 reference of the same
weights and batch; no collective issued by telemetry.
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

from ti_dist import combine_shards, scan_ranks
from ti_schema import DEFAULT_METRICS, parse_sharded_path

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

JOB = Path(__file__).with_name("parallel_job.py")
JOB_TIMEOUT_S = 180
QUARTILES = ("p25", "p50", "p75")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(root: Path, world: int, phases: list[dict[str, Any]]) -> Path:
    (root / "side").mkdir()
    for phase in phases:
        phase["out"] = str(root / phase["name"])
    cfg = {"world": world, "port": _free_port(), "side": str(root / "side"), "phases": phases}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, str(JOB), json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return root


@pytest.fixture(scope="module")
def job2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks: the ``tp`` and ``sp`` phases."""
    return _run(
        tmp_path_factory.mktemp("tp2"),
        2,
        [
            {"name": "tp", "kind": "tp", "steps": 3},
            {"name": "sp", "kind": "sp", "steps": 6, "interval": 0.05},
        ],
    )


@pytest.fixture(scope="module")
def job4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four ranks, a 2 x 2 mesh: the ``2d`` phase."""
    return _run(
        tmp_path_factory.mktemp("tp4"),
        4,
        [{"name": "2d", "kind": "2d", "steps": 5, "interval": 0.05}],
    )


def profile(values: np.ndarray) -> dict[str, float]:
    """The default profile of an array of finite entries, numpy float64."""
    flat = np.asarray(values, dtype=np.float64).ravel()
    quartiles = np.percentile(flat, [25, 50, 75])
    return {
        "mean": flat.mean(),
        "std": flat.std(),
        "min": flat.min(),
        "max": flat.max(),
        "p25": quartiles[0],
        "p50": quartiles[1],
        "p75": quartiles[2],
        "zero_fraction": float(np.mean(flat == 0)),
        "nonfinite_fraction": 0.0,
    }


def mlp_reference(w: Any, x: np.ndarray, prefix: str) -> dict[tuple[str, str], np.ndarray]:
    """(layer, signal) -> the whole tensor, of the MLP at its initial weights on ``x``, with
    the loss ``mean(out**2)``."""
    h0 = x @ w[f"{prefix}0.weight"].T + w[f"{prefix}0.bias"]
    h1 = np.maximum(h0, 0)
    out = h1 @ w[f"{prefix}2.weight"].T + w[f"{prefix}2.bias"]
    g_out = 2 * out / out.size
    g1 = g_out @ w[f"{prefix}2.weight"]
    g0 = g1 * (h0 > 0)
    return {
        (f"{prefix}0", "output"): h0,
        (f"{prefix}1", "output"): h1,
        (f"{prefix}2", "output"): out,
        (f"{prefix}0", "output_gradient"): g0,
        (f"{prefix}1", "output_gradient"): g1,
        (f"{prefix}2", "output_gradient"): g_out,
    }


def block_reference(w: Any, x: np.ndarray, world: int) -> dict[tuple[str, str], np.ndarray]:
    """The sequence-parallel block, each rank's loss ``mean(local_out**2)`` over its half."""
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    norm = (x - mu) / np.sqrt(var + 1e-5) * w["norm.weight"] + w["norm.bias"]
    up = norm @ w["up.weight"].T + w["up.bias"]
    act = np.maximum(up, 0)
    down = act @ w["down.weight"].T + w["down.bias"]
    g_down = 2 * down / (down.size / world)
    g_act = g_down @ w["down.weight"]
    g_up = g_act * (up > 0)
    g_norm = g_up @ w["up.weight"]
    values = {"norm": norm, "up": up, "act": act, "down": down}
    grads = {"norm": g_norm, "up": g_up, "act": g_act, "down": g_down}
    return {
        **{(k, "output"): v for k, v in values.items()},
        **{(k, "output_gradient"): v for k, v in grads.items()},
    }


def assert_profile(rows: pl.DataFrame, expected: dict[str, float], what: str) -> None:
    got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
    assert set(got) == set(DEFAULT_METRICS), what
    for metric, value in expected.items():
        assert got[metric] == pytest.approx(value, rel=1e-5, abs=1e-7), (what, metric)


def assert_parts_and_whole(
    out: Path, reference: dict[tuple[str, str], np.ndarray], ranks: list[int], sample: int = 0
) -> None:
    """Each rank's rows equal the reference's part it holds; ``combine_shards`` equals the
    whole (quartiles null: not combinable)."""
    history = scan_ranks(out).collect()
    rows = history.filter((pl.col("sample_id") == sample) & pl.col("rank").is_in(ranks))
    whole = combine_shards(out).filter(pl.col("sample_id") == sample)
    for (layer, signal), tensor in reference.items():
        mine = rows.filter((pl.col("layer") == layer) & (pl.col("signal") == signal))
        assert sorted(mine["rank"].unique().to_list()) == ranks, (layer, signal)
        paths = mine["tensor_path"].unique().to_list()
        assert len(paths) == 1, (layer, signal, paths)
        parsed = parse_sharded_path(paths[0])
        assert parsed is not None, (layer, signal, paths)
        dim = parsed.shard_dim
        for position, rank in enumerate(ranks):
            part = tensor if dim is None else np.array_split(tensor, len(ranks), axis=dim)[position]
            one = mine.filter(pl.col("rank") == rank)
            assert one["shape"][0].to_list() == list(part.shape), (layer, signal, rank)
            assert_profile(one, profile(part), f"{layer} {signal} rank {rank}")
        if dim is None:
            continue
        combined = whole.filter(
            (pl.col("layer") == layer)
            & (pl.col("signal") == signal)
            & (pl.col("tensor_path") == paths[0])
        )
        assert combined["ranks"][0].to_list() == ranks
        assert combined["shape"][0].to_list() == list(tensor.shape)
        expected = profile(tensor)
        for row in combined.iter_rows(named=True):
            if row["metric"] in QUARTILES:
                assert row["value"] is None
                assert row["unavailable_reason"].startswith("not comb")
            else:
                assert row["value"] == pytest.approx(expected[row["metric"]], rel=1e-5, abs=1e-7), (
                    layer,
                    signal,
                    row["metric"],
                )


def assert_no_telemetry_collectives(side: Path, phase: str, world: int) -> None:
    for rank in range(world):
        record = json.loads((side / f"{phase}-rank{rank}.json").read_text())
        assert record["observed"], "the profiler saw the job's own collectives"
        assert record["observed"] == record["bare"], (phase, rank, record)
        assert record["warnings"] == [], (phase, rank, record["warnings"])


def test_tensor_parallel_outputs_are_measured_per_shard_and_combine_exactly(job2: Path) -> None:
    """The issue's case: column- and row-wise layers with DTensor outputs, every rank: no row
    is null any more; each shard equals the reference's slice, combined the whole tensor."""
    side = job2 / "side"
    weights = np.load(side / "tp-weights.npz")
    x = np.load(side / "tp-rank0-x.npy")
    assert np.array_equal(x, np.load(side / "tp-rank1-x.npy"))
    reference = mlp_reference(weights, x, "mlp.")
    assert_parts_and_whole(job2 / "tp", reference, [0, 1])
    history = scan_ranks(job2 / "tp").collect()
    paths = dict(
        history.filter(pl.col("signal") == "output")
        .select("layer", "tensor_path")
        .unique()
        .iter_rows()
    )
    assert paths == {"mlp.0": "@S(1)", "mlp.1": "@S(1)", "mlp.2": "@R", "partial": "@P(sum)"}
    measured = history.filter(pl.col("layer") != "partial")
    assert measured["value"].null_count() == 0, measured.filter(pl.col("value").is_null())
    assert_no_telemetry_collectives(side, "tp", 2)


def test_a_partial_dtensor_is_never_presented_as_values(job2: Path) -> None:
    history = scan_ranks(job2 / "tp").collect().filter(pl.col("layer") == "partial")
    outputs = history.filter(pl.col("signal") == "output")
    assert outputs.height
    assert outputs["value"].null_count() == outputs.height
    assert set(outputs["unavailable_reason"]) == {
        "a partial DTensor (P(sum)): this rank holds a summand of each entry, not values of "
        "the tensor (measure it after its reduction, e.g. the next module's output)"
    }
    # its gradient arrives replicated: the path (the output's placements) would not say so
    gradients = history.filter(pl.col("signal") == "output_gradient")
    assert gradients.height
    assert gradients["value"].null_count() == gradients.height
    assert set(gradients["unavailable_reason"]) == {
        "the gradient's placements (R) differ from those of the output it answers "
        "(P(sum), in tensor_path): not measured"
    }
    assert combine_shards(job2 / "tp").filter(pl.col("layer") == "partial").is_empty()


def test_sequence_parallel_shards_combine_along_the_sequence(job2: Path) -> None:
    side = job2 / "side"
    weights = np.load(side / "sp-weights.npz")
    x = np.load(side / "sp-rank0-x.npy")
    reference = block_reference(weights, x, 2)
    assert_parts_and_whole(job2 / "sp", reference, [0, 1])
    history = scan_ranks(job2 / "sp").collect()
    # the aligned sampler: the same forwards sampled on both ranks
    samples = history.group_by("rank").agg(pl.col("forward_index").unique().sort())
    assert samples["forward_index"][0].to_list() == samples["forward_index"][1].to_list()
    paths = dict(history.select("layer", "tensor_path").unique().iter_rows())
    assert paths == {"norm": "@S(1)", "up": "@S(2)", "act": "@S(2)", "down": "@S(1)"}
    assert_no_telemetry_collectives(side, "sp", 2)


def test_2d_fsdp_and_tensor_parallel_combine_within_each_tensor_parallel_group(
    job4: Path,
) -> None:
    """A 2 x 2 mesh (dp, tp): the activations' submesh is named in the path, and shards are
    combined within each tensor-parallel group (each data-parallel group's own batch)."""
    side = job4 / "side"
    weights = np.load(side / "2d-weights.npz")
    history = scan_ranks(job4 / "2d").collect()
    for group in ([0, 1], [2, 3]):
        x = np.load(side / f"2d-rank{group[0]}-x.npy")
        assert np.array_equal(x, np.load(side / f"2d-rank{group[1]}-x.npy"))
        reference = mlp_reference(weights, x, "")
        mesh = ",".join(str(r) for r in group)
        layer0 = history.filter((pl.col("layer") == "0") & pl.col("rank").is_in(group))
        assert set(layer0["tensor_path"]) == {f"@S(1)#{mesh}"}
        assert_parts_and_whole(job4 / "2d", reference, group)
    assert not np.array_equal(np.load(side / "2d-rank0-x.npy"), np.load(side / "2d-rank2-x.npy"))
    assert_no_telemetry_collectives(side, "2d", 4)


@pytest.fixture(scope="module")
def pipeline_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two stages on two ranks: ``gpipe`` (two clean steps) and ``1f1b`` (NaNs made on rank 1
    from step 2 on), 4 microbatches each."""
    return _run(
        tmp_path_factory.mktemp("pp"),
        2,
        [
            {"name": "gpipe", "kind": "gpipe", "steps": 2, "microbatches": MICROBATCHES},
            {
                "name": "1f1b",
                "kind": "1f1b",
                "steps": 4,
                "microbatches": MICROBATCHES,
                "poison_step": POISON_STEP,
            },
            {
                "name": "miscounted",
                "kind": "gpipe",
                "steps": 1,
                "microbatches": MICROBATCHES,
                "declared_microbatches": 3,
            },
        ],
    )


MICROBATCHES = 4
POISON_STEP = 2


def pipeline_reference(w: Any, x: np.ndarray, y: np.ndarray) -> dict[tuple[str, str], np.ndarray]:
    """Every layer's output and output gradient for one microbatch (``x``, ``y``) of
    ``parallel_job.pipeline_model`` at its initial weights, loss ``mse(out, y)``."""
    a0 = x @ w["0.weight"].T + w["0.bias"]
    a1 = np.tanh(a0)
    a2 = a1 @ w["2.weight"].T + w["2.bias"]
    a3 = np.tanh(a2)
    a4 = a3 @ w["4.weight"].T + w["4.bias"]
    a5 = np.log(a4 + w["5.shift"])
    g5 = 2 * (a5 - y) / a5.size
    g4 = g5 / (a4 + w["5.shift"])
    g3 = g4 @ w["4.weight"]
    g2 = g3 * (1 - a3**2)
    g1 = g2 @ w["2.weight"]
    g0 = g1 * (1 - a1**2)
    outputs = (a0, a1, a2, a3, a4, a5)
    grads = (g0, g1, g2, g3, g4, g5)
    return {
        **{(str(i), "output"): v for i, v in enumerate(outputs)},
        **{(str(i), "output_gradient"): v for i, v in enumerate(grads)},
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_keep_the_model_names_and_their_microbatches(
    pipeline_job: Path, schedule: str
) -> None:
    """Each stage on its rank, named as in the whole model; every row knows its step and
    microbatch; each microbatch's output gradients answer its own forward (1F1B runs the
    backward of one microbatch between the forwards of others)."""
    from ti_dist import pipeline_rows

    side = pipeline_job / "side"
    rows = pipeline_rows(pipeline_job / schedule).collect()
    layers = rows.group_by("rank").agg(pl.col("layer").unique().sort()).sort("rank")
    assert layers["layer"].to_list() == [["0", "1", "2"], ["3", "4", "5"]]
    assert (rows["pipeline_stage"] == rows["rank"]).all()
    clean = rows.filter(pl.col("step") < 2)
    pairs = clean.select("rank", "step", "microbatch").unique().sort("rank", "step", "microbatch")
    expected = [(r, s, m) for r in (0, 1) for s in (0, 1) for m in range(MICROBATCHES)]
    assert pairs.rows() == expected
    weights = np.load(side / f"{schedule}-weights.npz")
    x, y = np.load(side / f"{schedule}-x.npy"), np.load(side / f"{schedule}-y.npy")
    step0 = rows.filter(pl.col("step") == 0)
    for microbatch in range(MICROBATCHES):
        part = slice(2 * microbatch, 2 * microbatch + 2)
        reference = pipeline_reference(weights, x[part], y[part])
        mine = step0.filter(pl.col("microbatch") == microbatch)
        for (layer, signal), tensor in reference.items():
            one = mine.filter((pl.col("layer") == layer) & (pl.col("signal") == signal))
            assert one["tensor_path"].to_list() == [""] * len(DEFAULT_METRICS)
            assert_profile(one, profile(tensor), f"{schedule} mb {microbatch} {layer} {signal}")
    for rank in (0, 1):
        record = json.loads((side / f"{schedule}-rank{rank}.json").read_text())
        assert record["warnings"] == []


def test_a_nan_made_on_one_stage_is_named_there_and_arrives_at_the_other(
    pipeline_job: Path,
) -> None:
    """The flight recorder in a 1F1B pipeline: the stage that makes the NaN replays it and
    names its module; the stage before it is told the NaN came with the gradient from the
    next stage's rank, never that its own modules or device made it."""
    from ti_dist import events_across_ranks

    events = events_across_ranks(pipeline_job / "1f1b")
    first = POISON_STEP * MICROBATCHES  # step 2, microbatch 0
    made = events.filter(pl.col("rank") == 1).row(0, named=True)
    assert (made["kind"], made["forward_index"], made["signal"], made["layer"]) == (
        "nonfinite",
        first,
        "output",
        "5",
    )
    assert made["replay"] == "reproduced"
    arrived = events.filter(pl.col("rank") == 0).row(0, named=True)
    assert (arrived["forward_index"], arrived["signal"]) == (first, "output_gradient")
    assert arrived["replay"] == "from_another_rank"
    assert "arrived from stage 1" in arrived["replay_reason"]


def test_a_miscounted_stage_warns_that_its_microbatches_are_wrong(pipeline_job: Path) -> None:
    for rank in (0, 1):
        record = json.loads((pipeline_job / "side" / f"miscounted-rank{rank}.json").read_text())
        assert record["warnings"] == [
            f"ti-core: pipeline stage {rank}: root forward 3 runs microbatch 3, not 0 of 3: the "
            "step and microbatch derived from forward_index are wrong from here on (pass "
            "inject_stage_observer(microbatches=) the schedule's n_microbatches)"
        ]


def test_ti_shards_prints_the_combined_tensors(
    job2: Path, pipeline_job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ti shards``: the whole tensors, as combine_shards has them; exit 2 when there is
    nothing sharded."""
    from ti_io.cli import main

    run = job2 / "sp"
    assert main(["shards", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == combine_shards(run).height
    assert main(["shards", str(run), "--layer", "up", "--metric", "std"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ti shards: 2 sharded tensors of {run}, whole-tensor values")
    assert "│ up " in out
    assert "norm" not in out
    assert "mean" not in out
    latest = (
        combine_shards(run)
        .filter(pl.col("layer") == "up", pl.col("signal") == "output", pl.col("metric") == "std")
        .sort("sample_id")
        .row(-1, named=True)
    )
    assert f"{latest['value']:.6f}"[:6] in out
    assert main(["shards", str(pipeline_job / "gpipe")]) == 2
    assert "no sharded tensor" in capsys.readouterr().err
