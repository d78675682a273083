"""What every callback shares, without a trainer: the rank decision from the trainer's rank,
the options checked at construction, one attach and one detach, and the missing-extra errors."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from _trainer_helpers import assert_clean, history, hook_counts
from torch import nn

from ti_core import AlwaysSampler, MemorySink, observer_of
from ti_io import DirectorySink
from ti_schema.layout import rank_dir_name
from ti_schema.testing import assert_artifact_dir_conforms
from ti_trainers import NothingObservedWarning, TrainerRanks
from ti_trainers.attachment import OPTION_NAMES, Attachment


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def train(net: nn.Module, steps: int = 3) -> list[np.ndarray]:
    """A few SGD steps; returns the first layer's output at each forward (float64)."""
    seen: list[np.ndarray] = []
    handle = net[0].register_forward_hook(
        lambda m, a, out: seen.append(out.detach().double().numpy())
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(5, 6, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    handle.remove()
    return seen


@pytest.mark.parametrize(
    ("name", "rank", "world", "observe", "subdir"),
    [
        ("rank0", 0, 1, True, None),
        ("rank0", 0, 4, True, None),
        ("rank0", 3, 4, False, None),
        ("all", 0, 1, True, "rank-000"),
        ("all", 3, 4, True, "rank-003"),
        ("all", 1000, 1024, True, "rank-1000"),
    ],
)
def test_trainer_ranks_decide_like_the_named_policies(
    name: str, rank: int, world: int, observe: bool, subdir: str | None
) -> None:
    selection = TrainerRanks(name, rank, world).select()  # type: ignore[arg-type]
    assert (selection.rank, selection.world_size) == (rank, world)
    assert selection.observe is observe
    assert selection.subdir == subdir
    if subdir is not None:
        assert subdir == rank_dir_name(rank)


def test_trainer_ranks_refuse_impossible_ranks() -> None:
    with pytest.raises(ValueError, match="not known"):
        TrainerRanks("rank1", 0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 2 of 2"):
        TrainerRanks("all", 2, 2)
    with pytest.raises(TypeError, match="rank must be an int"):
        TrainerRanks("all", True, 2)


def test_options_are_inject_observers_and_checked_at_construction() -> None:
    assert set(OPTION_NAMES) == {
        "output_dir",
        "sink",
        "sampler",
        "interval",
        "selector",
        "reducers",
        "histogram_selector",
        "max_histogram_modules",
        "rank_policy",
        "error_policy",
        "capture_direct_forwards",
        "handle_sigterm",
        "signals",
        "update_budget_bytes",
        "sentinel",
        "precision",
        "settings",
        "metrics",
    }
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*outputdir"):
        Attachment({"outputdir": "x"}, "Cb")
    with pytest.raises(ValueError, match=r"Cb\(rank_policy='rank1'\)"):
        Attachment({"rank_policy": "rank1"}, "Cb")
    with pytest.raises(TypeError, match="select"):
        Attachment({"rank_policy": 3}, "Cb")
    with pytest.raises(TypeError, match="output_dir"):
        Attachment({"output_dir": 3}, "Cb")
    with pytest.raises(ValueError, match="empty"):
        Attachment({"output_dir": ""}, "Cb")


def test_attach_writes_the_default_directory_and_detach_leaves_the_model_clean(
    tmp_path: Path,
) -> None:
    net = model()
    before = hook_counts(net)
    attachment = Attachment({"sampler": AlwaysSampler()}, "Cb")
    attachment.attach(net, default_dir=tmp_path / "stats", rank=0, world_size=1)
    assert attachment.attached
    assert attachment.output_dir == tmp_path / "stats"
    with pytest.raises(RuntimeError, match="already observing"):
        attachment.attach(net, default_dir=tmp_path / "other", rank=0, world_size=1)
    outputs = train(net)
    attachment.detach()
    attachment.detach()  # idempotent
    assert_clean(net, before)
    assert_artifact_dir_conforms(tmp_path / "stats")
    rows = history(tmp_path / "stats")
    std = rows.filter(
        (pl.col("layer") == "0") & (pl.col("signal") == "output") & (pl.col("metric") == "std")
    ).sort("sample_id")
    assert std.get_column("forward_index").to_list() == [0, 1, 2]
    for value, output in zip(std.get_column("value"), outputs, strict=True):
        assert value == pytest.approx(np.std(output), rel=1e-6)
    assert not (tmp_path / "other").exists()


def test_the_trainer_rank_decides_where_and_whether(tmp_path: Path) -> None:
    quiet = Attachment({}, "Cb")
    quiet.attach(model(), default_dir=tmp_path / "rank0", rank=1, world_size=2)
    assert not quiet.attached  # rank 1 under rank0: nothing attached, nothing written
    assert quiet.output_dir is None
    assert not (tmp_path / "rank0").exists()
    quiet.detach()

    every = Attachment({"rank_policy": "all", "sampler": AlwaysSampler()}, "Cb")
    net = model()
    every.attach(net, default_dir=tmp_path / "all", rank=1, world_size=2)
    assert every.output_dir == tmp_path / "all" / "rank-001"
    observer = observer_of(net)
    assert observer is not None
    assert (observer.run.rank, observer.run.world_size) == (1, 2)
    train(net, steps=1)
    every.detach()
    assert_artifact_dir_conforms(tmp_path / "all")
    assert history(tmp_path / "all" / "rank-001").get_column("rank").unique().to_list() == [1]


def test_a_uri_output_dir_is_where_the_rank_writes(tmp_path: Path) -> None:
    every = Attachment(
        {
            "output_dir": (tmp_path / "run").as_uri(),
            "rank_policy": "all",
            "sampler": AlwaysSampler(),
        },
        "Cb",
    )
    net = model()
    every.attach(net, default_dir=tmp_path / "default", rank=1, world_size=2)
    assert every.output_dir == tmp_path / "run" / "rank-001"  # the local path of file://
    train(net, steps=1)
    every.detach()
    assert history(tmp_path / "run" / "rank-001").get_column("rank").unique().to_list() == [1]


def test_given_output_dir_and_sinks_win_over_the_trainer(tmp_path: Path) -> None:
    net = model()
    own = Attachment({"output_dir": tmp_path / "mine", "sampler": AlwaysSampler()}, "Cb")
    own.attach(net, default_dir=tmp_path / "default", rank=0, world_size=1)
    train(net, steps=1)
    own.detach()
    assert (tmp_path / "mine" / "history.parquet").is_file()
    assert not (tmp_path / "default").exists()

    sink = DirectorySink(tmp_path / "sink")  # a directory sink of its own: no second directory
    given = Attachment({"sink": sink, "sampler": AlwaysSampler()}, "Cb")
    given.attach(net, default_dir=tmp_path / "default", rank=0, world_size=1)
    assert given.output_dir == tmp_path / "sink"
    train(net, steps=1)
    given.detach()
    assert (tmp_path / "sink" / "history.parquet").is_file()
    assert not (tmp_path / "default").exists()

    memory = MemorySink()
    in_memory = Attachment({"output_dir": None, "sink": memory}, "Cb")
    in_memory.attach(
        net, default_dir=tmp_path / "default", rank=0, world_size=1, extra_sinks=[MemorySink()]
    )
    assert in_memory.output_dir is None
    train(net, steps=1)
    in_memory.detach()
    assert memory.table().num_rows > 0
    assert not (tmp_path / "default").exists()


def test_a_module_never_called_is_reported(tmp_path: Path) -> None:
    net = model()
    attachment = Attachment({}, "Cb", hint="Call it.")
    attachment.attach(net, default_dir=tmp_path, rank=0, world_size=1)
    with pytest.warns(NothingObservedWarning, match="never called.*Call it."):
        attachment.detach()
    called = Attachment({}, "Cb")
    called.attach(net, default_dir=tmp_path / "again", rank=0, world_size=1)
    train(net, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingObservedWarning)
        called.detach()


def test_bad_options_leave_the_model_untouched(tmp_path: Path) -> None:
    """A bad value is refused when the callback is made (ti_core.options.Options, as
    inject_observer checks it); what needs the run (a sink) when the trainer starts, before
    the model is touched, and the attachment stays detached."""
    with pytest.raises(ValueError, match="max_histogram_modules"):
        Attachment({"max_histogram_modules": -1}, "Cb")
    with pytest.raises(TypeError, match="error_policy"):
        Attachment({"error_policy": 3}, "Cb")
    net = model()
    before = hook_counts(net)
    attachment = Attachment({"sink": object()}, "Cb")
    with pytest.raises(TypeError, match="Sink protocol"):
        attachment.attach(net, default_dir=tmp_path, rank=0, world_size=1)
    assert not attachment.attached
    assert_clean(net, before)


def test_no_trainer_library_is_loaded_and_a_missing_extra_names_its_install_command() -> None:
    """In a fresh interpreter (one, as importing torch is slow): ``import ti_trainers`` loads
    neither Lightning nor transformers; with one of them missing, using its callback raises an
    ImportError naming the extra to install, caused by the failed import."""
    code = (
        "import sys\n"
        "import ti_trainers\n"
        "print('lightning' in sys.modules, 'transformers' in sys.modules)\n"
        "sys.modules['lightning'] = None  # as if neither were installed\n"
        "sys.modules['transformers'] = None\n"
        "for name in ('LightningObserverCallback', 'HFObserverCallback'):\n"
        "    try:\n"
        "        getattr(ti_trainers, name)\n"
        "    except ImportError as exc:\n"
        "        print(type(exc.__cause__).__name__, '|', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    loaded, lightning, transformers = done.stdout.strip().splitlines()
    assert loaded.split() == ["False", "False"]
    for line, library in ((lightning, "lightning"), (transformers, "transformers")):
        cause, message = line.split(" | ")
        assert cause in {"ImportError", "ModuleNotFoundError"}
        assert f"`{library}`" in message
        assert f'pip install "ti-trainers[{library}]"' in message
