"""The flight recorder end to end: real training processes with ``sentinel=True`` writing runs
through ti-io's DirectorySink, a ``kill -9`` after the event, and a two-process gloo job in
which only rank 1 goes non-finite (read back with ti-dist)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

from ti_dist import events_across_ranks, first_event
from ti_io import read_events, scan_history
from ti_io.cli import main as cli_main
from ti_schema.layout import EVENT_PARTS, EVENTS_FILE

JOB_TIMEOUT_S = 240

# A real model whose Log module produces NaN from the forward ``argv[2]`` on (its input turns
# negative); the optimizer never steps, so the weights stay finite.
MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.log = Log()
            self.out = nn.Linear(8, 1)
            self.shift = 1.0

        def forward(self, x):
            return self.out(self.log(self.inp(x).abs() + self.shift))
    """
)

KILLED = MODEL + textwrap.dedent(
    """
    import os, signal, sys, time
    from ti_core import EveryNForwardsSampler, inject_observer

    torch.manual_seed(0)
    model = Net()
    inject_observer(
        model, output_dir=sys.argv[1], sampler=EveryNForwardsSampler(10**9), sentinel=True
    )
    for step in range(8):
        if step == int(sys.argv[2]):
            model.shift = -100.0
        model.zero_grad()
        model(torch.rand(16, 4)).sum().backward()
    time.sleep(2.5)  # the 1-s flush clock publishes the dense rows; nothing finalizes
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.slow
def test_the_event_and_its_dense_rows_survive_kill_9_and_consolidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "stats"
    done = subprocess.run(
        [sys.executable, "-c", KILLED, str(out), "3"],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (out / EVENT_PARTS).is_dir()
    assert not (out / EVENTS_FILE).exists()
    assert read_events(out).column("layer").to_pylist() == ["log"]  # the live run

    assert cli_main(["consolidate", str(out)]) == 0
    (event,) = read_events(out).to_pylist()
    assert (event["kind"], event["signal"], event["forward_index"]) == ("nonfinite", "output", 3)
    assert (event["layer"], event["layers"]) == ("log", ["log", "out"])
    assert event["replay"] == "reproduced"  # the default sentinel replayed the step
    assert (event["dense_first_forward"], event["dense_forwards"]) == (4, 4)
    history = scan_history(out).collect()
    assert sorted(history["forward_index"].unique().to_list()) == [0, 4, 5, 6, 7]
    dense = history.filter(
        pl.col("forward_index").is_between(4, 7),
        pl.col("layer") == "log",
        pl.col("signal") == "output",
        pl.col("metric") == "nonfinite_fraction",
    )
    assert dense.height == 4
    assert (dense["value"] > 0).all()
    assert cli_main(["validate", str(out)]) == 0
    index = (out / "index.md").read_text()
    assert index.index("log") < index.index("## Run")  # the event is listed first
    assert 'replay: "reproduced"' in index.split("## Run")[0]
    capsys.readouterr()
    assert cli_main(["summary", str(out)]) == 0
    assert "replay reproduced ('log' is the first module" in capsys.readouterr().out


WORKER = MODEL + textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from ti_core import EveryNForwardsSampler, inject_observer, remove_observer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    inject_observer(
        model,
        output_dir=sys.argv[1],
        sampler=EveryNForwardsSampler(10**9),
        rank_policy="all",
        sentinel=True,
    )
    shard = torch.Generator().manual_seed(100 + rank)
    for step in range(6):
        if rank == 1 and step == 2:
            model.shift = -100.0  # only rank 1 breaks
        model.zero_grad()
        loss = model(torch.rand(16, 4, generator=shard)).sum()
        loss.backward()
        seen = torch.tensor([float(torch.isfinite(loss))])
        dist.all_reduce(seen)  # a real collective every step
    remove_observer(model)
    dist.destroy_process_group()
    """
)


DDP_WORKER = MODEL + textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from ti_core import EveryNForwardsSampler, inject_observer, remove_observer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    model = DistributedDataParallel(net)
    # the default sentinel: replay mode
    inject_observer(
        model, output_dir=sys.argv[1], sampler=EveryNForwardsSampler(10**9), rank_policy="all"
    )
    shard = torch.Generator().manual_seed(100 + rank)
    for step in range(6):
        net.shift = -100.0 if (rank == 1 and step == 2) else 1.0  # rank 1's batch 2 breaks
        model.zero_grad()
        model(torch.rand(16, 4, generator=shard)).sum().backward()  # DDP all-reduces
    remove_observer(model)
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_ranks(tmp_path: Path, worker: str, out: Path) -> None:
    """Run ``worker`` as ranks 0 and 1 of a gloo job writing to ``out``; both must succeed."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [p.communicate(timeout=JOB_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], json.dumps(logs)


@pytest.mark.slow
@pytest.mark.distributed
def test_only_rank_1_goes_non_finite_and_ti_dist_names_it(tmp_path: Path) -> None:
    out = tmp_path / "job"
    _two_ranks(tmp_path, WORKER, out)
    assert read_events(out / "rank-000").num_rows == 0  # an empty table, not a missing file
    assert (out / "rank-000" / EVENTS_FILE).is_file()
    first = first_event(out)
    assert first is not None
    assert (first["rank"], first["forward_index"], first["layer"]) == (1, 2, "log")
    assert events_across_ranks(out)["rank"].to_list() == [1]


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_the_rank_that_made_the_nan_reproduces_it_the_other_is_told_it_came_from_there(
    tmp_path: Path,
) -> None:
    """DDP on two gloo ranks, only rank 1's batch poisoned at step 2: its forward is not
    finite and its replay reproduces it, naming the module; rank 0's forward is clean, its
    gradients (averaged with rank 1's) are not, and its own replay is clean: the NaN came from
    another rank, not from its device."""
    out = tmp_path / "job"
    _two_ranks(tmp_path, DDP_WORKER, out)
    (made,) = read_events(out / "rank-001").to_pylist()
    assert (made["signal"], made["forward_index"], made["replay"]) == ("output", 2, "reproduced")
    assert (made["layer"], made["module_type"]) == ("log", "Log")
    (arrived,) = read_events(out / "rank-000").to_pylist()
    assert (arrived["signal"], arrived["forward_index"]) == ("output_gradient", 2)
    assert arrived["replay"] == "from_another_rank"
    assert "rank 0, device cpu" in arrived["replay_reason"]
    # the event names the gradient the check saw non-finite: out's weight (its input was NaN
    # on rank 1; log's backward divides by a finite value, so inp's stayed finite)
    assert (arrived["layer"], arrived["tensor_path"]) == ("out", "weight.grad")
    assert arrived["layers"] == ["out"]
    first = first_event(out)
    assert first is not None
    assert (first["rank"], first["replay"], first["layer"]) == (1, "reproduced", "log")
