"""Rank policies on real multi-process jobs (gloo on CPU), with ti-io's DirectorySink.

Each job trains a small model with DDP (or FSDP2 ``fully_shard``); every rank draws its own
data shard, so per-rank measurements differ. The 4-process job starts through torchrun. The
2-process jobs start one plain process per rank with the environment torchrun would give it:
torchrun tears the whole job down when one worker dies, which the killed-rank job must avoid,
and one launcher process fewer keeps the jobs short on a small machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ti_core import has_observer, inject_observer
from ti_dist import combine_shards, compare_ranks, scan_ranks
from ti_io import consolidate
from ti_schema import DEFAULT_METRICS, PARAMETER_SIGNALS, SIGNALS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

JOB_TIMEOUT_S = 180
STEPS = 4
ARTIFACT_FILES = (
    "history.parquet",
    "histograms.parquet",
    "events.parquet",
    "result.json",
    "index.md",
)

# The training script every rank runs. argv[1]: JSON settings (see job_config): one or more
# phases, each a fresh model trained for a few steps with its own rank policy, output_dir,
# parallelism ("ddp" or "fsdp2") and, optionally, a rank that kills itself at the end.
WORKER = r"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ti_core import AlwaysSampler, has_observer, inject_observer, remove_observer

cfg = json.loads(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
side = Path(cfg["side"])


def observe_wrapped(name):
    # Observe the wrapped model itself, in every wrapping; record what the observer named.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ti_core import MemorySink

    def fsdp2(model):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)  # in place: the model stays a Sequential with the same names
        return model

    wrappings = {
        "bare": lambda m: m,
        "ddp": DDP,
        "ddp(compile)": lambda m: DDP(torch.compile(m, backend="eager")),
        "compile(ddp)": lambda m: torch.compile(DDP(m), backend="eager"),
    }
    if cfg["fully_shard"]:
        wrappings["fully_shard"] = fsdp2
    found = {}
    for wrapping, wrap in wrappings.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        leaves = [n for n, m in model.named_modules() if next(m.children(), None) is None]
        net = wrap(model)
        sink = MemorySink()
        inject_observer(
            net, output_dir=None, sink=sink, sampler=AlwaysSampler(), rank_policy="all"
        )
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        shard = torch.Generator().manual_seed(1000 + rank)
        for _ in range(2):
            x = torch.randn(16, 8, generator=shard)
            y = torch.randn(16, 4, generator=shard)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        remove_observer(net)
        rows = sink.table().to_pylist()
        found[wrapping] = {
            "leaves": leaves,
            "catalog": [layer.name for layer in sink.run.layers],
            "layers": sorted({r["layer"] for r in rows}),
            "ranks": sorted({r["rank"] for r in rows}),
            "samples": sorted({r["sample_id"] for r in rows}),
            "first": {
                f"{r['layer']}|{r['signal']}|{r['metric']}": r["value"]
                for r in rows
                if r["sample_id"] == 0
            },
        }
    (side / f"{name}-rank{rank}.json").write_text(json.dumps(found))


for phase in cfg["phases"]:
    out, name, mode = Path(phase["out"]), phase["name"], phase["mode"]
    if mode == "wrapped":
        observe_wrapped(name)
        continue
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)

    policy = phase["policy"]
    if isinstance(policy, list):  # an explicit set of ranks
        from ti_dist import Ranks

        policy = Ranks(policy)
    options = {"sampler": AlwaysSampler(), "rank_policy": policy}
    if phase["signals"]:
        options["signals"] = phase["signals"]
    if phase["buffer_rows"]:
        from ti_io import DirectorySink, HistoryConfig

        config = HistoryConfig(buffer_rows=phase["buffer_rows"])
        options["sink"] = DirectorySink(out, history_config=config)
    else:
        options["output_dir"] = out
    inject_observer(model, **options)
    hooks = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )
    facts = {"rank": rank, "world": world, "observed": has_observer(model), "hooks": hooks}
    (side / f"{name}-rank{rank}.json").write_text(json.dumps(facts))

    net = model
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    shard = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    def whole(tensor):
        # every rank takes part in gathering a DTensor (a collective); a plain tensor is whole
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        return full.detach().double().numpy().copy()

    for step in range(phase["steps"]):
        x = torch.randn(16, 8, generator=shard)
        y = torch.randn(16, 4, generator=shard)
        if step == 0 and mode == "ddp":
            with torch.no_grad():
                first = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
            np.save(side / f"{name}-rank{rank}-layer0-output.npy", first.numpy())
        reference = step == 0 and phase["signals"]
        if reference:  # layer 2's weight: its value, gradient and update at step 0, whole
            value = whole(model[2].weight)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        if reference:
            grad = whole(model[2].weight.grad)
        opt.step()
        if reference:
            update = whole(model[2].weight) - value
            for part, array in (("value", value), ("grad", grad), ("update", update)):
                np.save(side / f"{name}-rank{rank}-weight-{part}.npy", array)
        opt.zero_grad()

    # No collective after this point: a rank may die here without stranding the others.
    if rank == phase["kill_rank"]:
        parts = out / f"rank-{rank:03d}" / "history.parts"
        deadline = time.monotonic() + 60
        while len(list(parts.glob("part-*.parquet"))) < phase["min_parts"]:
            if time.monotonic() > deadline:
                sys.exit("timed out waiting for published parts")
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    if phase["kill_rank"] is not None:
        with torch.no_grad():  # a local evaluation phase, no collectives
            model.eval()
            model(torch.randn(16, 8, generator=shard))
    remove_observer(model)
dist.destroy_process_group()
# torch 2.13's gloo sometimes aborts while the interpreter tears down after this clean
# destroy_process_group ("terminate called without an active exception", SIGABRT; about one
# 4-process job in five on an AVX-512 machine, in a rank whose work had all completed). Every
# artifact is finalized and closed by now, so the worker ends without that teardown.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def phase(
    name: str, policy: str | list[int], mode: str = "ddp", **overrides: Any
) -> dict[str, Any]:
    """One phase of a job: a fresh model, ``STEPS`` training steps, written to ``<root>/name``.
    ``policy``: a policy name, or a list of ranks for ``ti_dist.Ranks``."""
    settings: dict[str, Any] = {
        "name": name,
        "policy": policy,
        "mode": mode,
        "steps": STEPS,
        "buffer_rows": None,
        "kill_rank": None,
        "min_parts": 0,
        "signals": None,
    }
    settings.update(overrides)
    return settings


def job_config(root: Path, phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Settings for one job running ``phases`` in order; writes the worker to root/worker.py."""
    for item in phases:
        item["out"] = str(root / item["name"])
    (root / "side").mkdir(parents=True, exist_ok=True)
    (root / "worker.py").write_text(WORKER)
    return {"phases": phases, "side": str(root / "side")}


def _log(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    return path.read_text(errors="replace")[-6000:] if path.exists() else ""


def torchrun(tmp_path: Path, nproc: int, cfg: dict[str, Any]) -> None:
    """Run the worker under torchrun on this machine; fail with its output on error."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(tmp_path / "worker.py"),
        json.dumps(cfg),
    ]
    with (tmp_path / "torchrun.log").open("w") as log:
        try:
            proc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_clean_env(),
                timeout=JOB_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun job timed out:\n{_log(tmp_path, 'torchrun.log')}")
    assert proc.returncode == 0, _log(tmp_path, "torchrun.log")


def launch_ranks(tmp_path: Path, world: int, cfg: dict[str, Any]) -> list[int]:
    """Start one plain process per rank with torchrun's environment; return exit codes."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = _clean_env()
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        log = (tmp_path / f"rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(tmp_path / "worker.py"), json.dumps(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
        log.close()
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=JOB_TIMEOUT_S))
    except subprocess.TimeoutExpired:
        logs = "\n".join(_log(tmp_path, f"rank{r}.log") for r in range(world))
        pytest.fail(f"job timed out:\n{logs}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes


def side_facts(root: Path, phase: str, rank: int) -> dict[str, Any]:
    facts: dict[str, Any] = json.loads((root / "side" / f"{phase}-rank{rank}.json").read_text())
    return facts


def assert_full_artifacts(directory: Path, rank: int, samples: int = STEPS) -> pl.DataFrame:
    """The directory holds a finished run written by ``rank``; return its history."""
    for name in ARTIFACT_FILES:
        assert (directory / name).is_file(), f"{directory / name} missing"
    assert not (directory / "history.parts").exists()
    events = list((directory / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {directory / 'tensorboard'}"
    accumulator = EventAccumulator(str(events[0].parent), size_guidance={"histograms": 0})
    accumulator.Reload()
    assert accumulator.Tags()["histograms"], f"no histograms in {events[0]}"

    history = pl.read_parquet(directory / "history.parquet")
    assert history["rank"].unique().to_list() == [rank]
    assert history["run_id"].n_unique() == 1
    assert sorted(history["sample_id"].unique().to_list()) == list(range(samples))
    histograms = pq.read_table(directory / "histograms.parquet", columns=["rank"])
    assert histograms.num_rows > 0
    assert set(histograms.column("rank").to_pylist()) == {rank}
    result = json.loads((directory / "result.json").read_text())
    assert {record["layer"] for record in result} == {"0", "1", "2"}
    return history


def first_output_stats(history: pl.DataFrame) -> dict[str, float]:
    """Metric -> value of layer "0"'s output at sample 0."""
    rows = history.filter(
        (pl.col("layer") == "0") & (pl.col("signal") == "output") & (pl.col("sample_id") == 0)
    )
    return dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun job of 4 DDP processes, observed three times in turn: with
    rank_policy="rank0", "all", and Ranks([1, 3])."""
    root = tmp_path_factory.mktemp("ddp4")
    phases = [
        phase("rank0", "rank0"),
        phase("all", "all", signals=list(SIGNALS)),
        phase("some", [1, 3]),
    ]
    cfg = job_config(root, phases)
    torchrun(root, 4, cfg)
    return root


def test_rank0_policy_only_rank0_writes_in_output_dir(ddp_job: Path) -> None:
    """A visibly distributed job (torchrun, WORLD_SIZE=4) with rank_policy="rank0"."""
    out = ddp_job / "rank0"
    assert sorted(p.name for p in out.iterdir()) == sorted([*ARTIFACT_FILES, "tensorboard"])
    history = assert_full_artifacts(out, rank=0)
    rank0 = side_facts(ddp_job, "rank0", 0)
    assert (rank0["rank"], rank0["world"], rank0["observed"]) == (0, 4, True)
    assert rank0["hooks"] > 0
    # The other ranks attached nothing: no observer, no hooks, no files.
    for rank in (1, 2, 3):
        expected = {"rank": rank, "world": 4, "observed": False, "hooks": 0}
        assert side_facts(ddp_job, "rank0", rank) == expected
    assert scan_ranks(out).collect().height == history.height


def test_all_ranks_ddp_four_processes(ddp_job: Path) -> None:
    out = ddp_job / "all"
    assert sorted(p.name for p in out.iterdir()) == [f"rank-00{r}" for r in range(4)]
    histories = {}
    for rank in range(4):
        assert side_facts(ddp_job, "all", rank)["observed"] is True
        history = assert_full_artifacts(out / f"rank-00{rank}", rank)
        histories[rank] = history
        # This rank's rows measure this rank's own first-layer output (numpy float64 reference).
        reference = np.load(ddp_job / "side" / f"all-rank{rank}-layer0-output.npy")
        reference = reference.astype(np.float64)
        stats = first_output_stats(history)
        expected = {
            "mean": reference.mean(),
            "std": reference.std(),
            "min": reference.min(),
            "max": reference.max(),
            "p25": np.percentile(reference, 25),
            "p50": np.percentile(reference, 50),
            "p75": np.percentile(reference, 75),
            "zero_fraction": float(np.mean(reference == 0)),
            "nonfinite_fraction": 0.0,
        }
        for metric, value in expected.items():
            assert stats[metric] == pytest.approx(value, rel=1e-5, abs=1e-7), (rank, metric)

    means = [first_output_stats(histories[r])["mean"] for r in range(4)]
    assert len(set(means)) == 4, f"ranks measured identical inputs: {means}"
    assert len({histories[r]["run_id"][0] for r in range(4)}) == 4

    combined = scan_ranks(out).collect()
    assert combined.height == sum(h.height for h in histories.values())
    assert combined.group_by("rank").len().sort("rank")["len"].to_list() == [
        histories[r].height for r in range(4)
    ]

    table = compare_ranks(out, layer="0", signal="output", metric="mean")
    assert table["sample_id"].to_list() == list(range(STEPS))
    assert table["n_ranks"].to_list() == [4] * STEPS
    first = table.row(0, named=True)
    assert first["values"] == pytest.approx(means, rel=1e-12)
    assert first["spread"] == pytest.approx(max(means) - min(means), rel=1e-12)
    # Output gradients are each rank's own too (DDP averages parameter gradients only).
    grads = compare_ranks(out, layer="2", signal="output_gradient", metric="std")
    assert grads["n_ranks"].to_list() == [4] * STEPS
    assert (grads["spread"] > 0).all()


def reference_profile(values: np.ndarray) -> dict[str, float]:
    """The default profile of a tensor with only finite entries, numpy float64."""
    flat = values.astype(np.float64).ravel()
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


SIGNAL_PARTS = (
    ("parameter", "value"),
    ("parameter_gradient", "grad"),
    ("parameter_update", "update"),
)


def test_ddp_parameters_are_replicas_with_averaged_gradients(ddp_job: Path) -> None:
    """The "all" phase also recorded the parameter signals. DDP parameters are replicas: every
    rank measures the same values, the same (all-reduced) gradient and the same update, each
    equal to the whole tensor the rank itself saw; the output gradients stay per rank."""
    out = ddp_job / "all"
    for rank in range(4):
        history = pl.read_parquet(out / f"rank-00{rank}" / "history.parquet")
        # every signal but attention (the MLP makes no attention call); optimizer_state rows
        # say SGD holds no moments
        assert set(history["signal"].unique()) == set(SIGNALS) - {"attention"}
        for name, part in SIGNAL_PARTS:
            reference = np.load(ddp_job / "side" / f"all-rank{rank}-weight-{part}.npy")
            rows = history.filter(
                (pl.col("layer") == "2")
                & (pl.col("tensor_path") == "weight")
                & (pl.col("signal") == name)
                & (pl.col("sample_id") == 0)
            )
            got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
            for metric, value in reference_profile(reference).items():
                assert got[metric] == pytest.approx(value, rel=1e-5, abs=1e-8), (rank, name)
    table = compare_ranks(out, signal=list(PARAMETER_SIGNALS))
    assert (
        table.height == 3 * 4 * len(DEFAULT_METRICS) * STEPS
    )  # 3 signals x 4 tensors x metrics x samples
    assert (table["n_ranks"] == 4).all()
    assert (table["spread"].fill_null(0.0) == 0.0).all(), "DDP replicas differ across ranks"


def test_explicit_ranks_observe_only_those_ranks(ddp_job: Path) -> None:
    out = ddp_job / "some"
    assert sorted(p.name for p in out.iterdir()) == ["rank-001", "rank-003"]
    for rank in (0, 1, 2, 3):
        facts = side_facts(ddp_job, "some", rank)
        assert facts["observed"] is (rank in (1, 3))
        if rank in (0, 2):
            assert facts["hooks"] == 0
    histories = {r: assert_full_artifacts(out / f"rank-00{r}", r) for r in (1, 3)}
    combined = scan_ranks(out).collect()
    assert sorted(combined["rank"].unique().to_list()) == [1, 3]
    assert combined.height == histories[1].height + histories[3].height
    # Same data and weights as in the "all" phase: rank 3 measured the same tensors again.
    again = pl.read_parquet(ddp_job / "all" / "rank-003" / "history.parquet")
    assert first_output_stats(histories[3]) == first_output_stats(again)


def _fully_shard_missing() -> str | None:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the installed torch
        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard: {exc}"
    return None


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """One job of 2 plain processes: the wrapped models observed directly (DDP, compiled, FSDP2),
    FSDP2 with "all", then DDP with "all" where rank 1 kills itself (SIGKILL) after its last
    collective, before removing its observer."""
    root = tmp_path_factory.mktemp("job2")
    phases = [phase("wrapped", "all", mode="wrapped")]
    if not _fully_shard_missing():
        phases.append(phase("fsdp", "all", mode="fsdp2", signals=list(SIGNALS)))
    phases.append(phase("killed", "all", buffer_rows=64, kill_rank=1, min_parts=2))
    cfg = job_config(root, phases)
    cfg["fully_shard"] = _fully_shard_missing() is None
    codes = launch_ranks(root, 2, cfg)
    return root, codes


def test_wrapped_models_are_named_like_the_bare_model(
    two_rank_job: tuple[Path, list[int]],
) -> None:
    """inject_observer on DistributedDataParallel(model), DDP of a compiled model, a compiled
    DDP and an FSDP2 ``fully_shard`` model, in real gloo processes: the layers carry the bare
    model's ``named_modules()`` names (no ``module.`` / ``_orig_mod.`` prefix), and the first
    sample (same weights, same data) measures what the unwrapped model measures."""
    root, codes = two_rank_job
    assert codes == [0, -signal.SIGKILL], [_log(root, f"rank{r}.log") for r in range(2)]
    expected = ["ddp", "ddp(compile)", "compile(ddp)"]
    if not _fully_shard_missing():
        expected.append("fully_shard")
    for rank in range(2):
        found = side_facts(root, "wrapped", rank)
        bare = found.pop("bare")
        assert bare["layers"] == bare["leaves"] == ["0", "1", "2"]
        assert sorted(found) == sorted(expected)
        for wrapping, facts in found.items():
            assert facts["catalog"] == facts["leaves"] == ["0", "1", "2"], wrapping
            assert facts["layers"] == ["0", "1", "2"], wrapping
            assert facts["ranks"] == [rank]
            assert facts["samples"] == [0, 1], wrapping
            assert facts["first"].keys() == bare["first"].keys(), wrapping
            for key, value in bare["first"].items():
                assert facts["first"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (
                    wrapping,
                    key,
                )


def test_fsdp2_fully_shard_all_ranks(two_rank_job: tuple[Path, list[int]]) -> None:
    missing = _fully_shard_missing()
    if missing:  # pragma: no cover - depends on the installed torch
        pytest.skip(missing)
    root, codes = two_rank_job
    assert codes == [0, -signal.SIGKILL], [_log(root, f"rank{r}.log") for r in range(2)]
    out = root / "fsdp"
    histories = [assert_full_artifacts(out / f"rank-00{r}", r) for r in range(2)]
    assert first_output_stats(histories[0])["mean"] != first_output_stats(histories[1])["mean"]
    combined = scan_ranks(out).collect()
    assert sorted(combined["rank"].unique().to_list()) == [0, 1]
    assert combined.height == histories[0].height + histories[1].height

    # Each rank measured its own shard of every parameter: rows of layer 2's weight carry the
    # local shape (2 of its 4 rows) and the placement; combined, they are the whole parameter.
    local = combined.filter((pl.col("layer") == "2") & (pl.col("tensor_path") == "weight@S(0)"))
    assert set(local["signal"].unique()) == set(PARAMETER_SIGNALS)
    assert {tuple(shape) for shape in local["shape"].to_list()} == {(2, 16)}
    whole = combine_shards(out).filter(
        (pl.col("layer") == "2") & (pl.col("parameter") == "weight") & (pl.col("sample_id") == 0)
    )
    assert whole.height == 3 * len(DEFAULT_METRICS)
    for name, part in SIGNAL_PARTS:
        reference = reference_profile(np.load(root / "side" / f"fsdp-rank0-weight-{part}.npy"))
        for row in whole.filter(pl.col("signal") == name).iter_rows(named=True):
            assert (row["shape"], row["ranks"]) == ([4, 16], [0, 1])
            if row["metric"] in ("p25", "p50", "p75"):
                assert row["value"] is None
                assert row["unavailable_reason"].startswith("not combinable")
            else:
                assert row["value"] == pytest.approx(
                    reference[row["metric"]], rel=1e-5, abs=1e-8
                ), (name, row["metric"])


def test_killed_rank_leaves_others_complete_and_its_parts_consolidatable(
    two_rank_job: tuple[Path, list[int]],
) -> None:
    root, codes = two_rank_job
    assert codes == [0, -signal.SIGKILL], [_log(root, f"rank{r}.log") for r in range(2)]

    out = root / "killed"
    # The survivor also sampled its local evaluation forward after rank 1 died.
    survivor = assert_full_artifacts(out / "rank-000", rank=0, samples=STEPS + 1)
    assert survivor.filter(pl.col("mode") == "eval")["sample_id"].unique().to_list() == [STEPS]

    killed = out / "rank-001"
    assert not (killed / "history.parquet").exists()
    parts = sorted((killed / "history.parts").glob("part-*.parquet"))
    assert len(parts) >= 2
    part_rows = sum(pq.read_metadata(p).num_rows for p in parts)

    live = scan_ranks(out).collect()
    assert live.filter(pl.col("rank") == 1).height == part_rows
    assert live.filter(pl.col("rank") == 0).height == survivor.height

    done = consolidate(killed)
    assert done.history_rows == part_rows
    recovered = pl.read_parquet(killed / "history.parquet")
    assert recovered["rank"].unique().to_list() == [1]
    assert recovered.height == part_rows
    assert (killed / "result.json").is_file()
    assert (killed / "index.md").is_file()
    assert not (killed / "history.parts").exists()
    after = scan_ranks(out).collect()
    assert after.filter(pl.col("rank") == 1).height == part_rows


def test_unknown_policy_name_is_a_clear_error(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"rank_policy='every-other' is not known.*all.*rank0"):
        inject_observer(model, output_dir=tmp_path / "stats", rank_policy="every-other")
    assert not has_observer(model)
    assert not (tmp_path / "stats").exists()
