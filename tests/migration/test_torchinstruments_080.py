"""Against the released torchinstruments 0.8.0 (the ``legacy`` nox session installs it, with its
own dependencies: Polars < 2). Runs it writes, finalized or killed, are recognized by every
``ti`` command, upgraded, validated and summarized, and give the numbers 0.8.0 gave; its own
sinks run fed by ti-core. Skipped where 0.8.0 is not installed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch

ti08 = pytest.importorskip(
    "torchinstruments", reason="needs torchinstruments 0.8.0: `nox -s legacy` installs it"
)

from _migration_models import STEPS, Net, train_steps  # noqa: E402

from ti_core import AlwaysSampler, MemorySink, inject_observer, remove_observer  # noqa: E402
from ti_core.legacy import legacy_path  # noqa: E402
from ti_io import upgrade  # noqa: E402
from ti_io.cli import main  # noqa: E402
from ti_schema import parse_metadata  # noqa: E402
from ti_schema.legacy_paths import modern_path  # noqa: E402
from ti_schema.testing import assert_artifact_dir_conforms  # noqa: E402

pytestmark = pytest.mark.slow
AGGREGATES = ("mean", "std", "min", "p25", "p50", "p75", "max")
WINDOW = 3


KILLED = r"""
import os, signal, sys, torch
sys.path.insert(0, sys.argv[2])
import _migration_models as t
import torchinstruments
torch.manual_seed(0)
model = t.Net()
torchinstruments.inject_observer(
    model, output_dir=sys.argv[1], sampler=torchinstruments.AlwaysSampler()
)
t.train_steps(model, 3)
os.kill(os.getpid(), signal.SIGKILL)  # no remove_observer: the run stays in history.parts/
"""


@pytest.fixture(scope="module")
def old_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``done/``: a finished 0.8.0 run (window 3); ``killed/``: one whose process was killed."""
    root = tmp_path_factory.mktemp("ti080")
    assert ti08.__version__ == "0.8.0"
    torch.manual_seed(0)
    model = Net()
    ti08.inject_observer(
        model,
        output_dir=root / "done",
        sampler=ti08.AlwaysSampler(),
        history_config=ti08.HistoryConfig(window=WINDOW),
    )
    train_steps(model, STEPS)
    ti08.remove_observer(model)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED, str(root / "killed"), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    return root


def ti(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ti_io.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_every_ti_command_says_in_one_line_that_the_run_is_0_8_0(old_runs: Path) -> None:
    for command, directory in (
        ("summary", "done"),
        ("validate", "done"),
        ("consolidate", "killed"),
    ):
        done = ti(command, str(old_runs / directory))
        assert done.returncode == 1
        assert done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "written by torchinstruments 0.8.0" in done.stderr
        assert "ti upgrade" in done.stderr
    # consolidate left the killed run's parts alone
    assert sorted(p.name for p in (old_runs / "killed" / "history.parts").glob("*.parquet"))


def test_an_upgraded_0_8_0_run_validates_summarizes_and_gives_0_8_0s_numbers(
    old_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = old_runs / "done", tmp_path / "new"
    assert main(["upgrade", str(old), str(new)]) == 0
    capsys.readouterr()
    assert main(["validate", str(new)]) == 0
    assert capsys.readouterr().out.strip() == "ok"
    assert_artifact_dir_conforms(new)
    assert main(["summary", str(new)]) == 0
    assert "upgraded from torchinstruments 0.8.0" in capsys.readouterr().out

    footer = parse_metadata(pl.read_parquet_metadata(new / "history.parquet"))
    assert (footer["window"], footer["upgraded_from"]) == (WINDOW, "torchinstruments 0.8.0")
    before = pl.read_parquet(old / "history.parquet")
    after = pl.read_parquet(new / "history.parquet")
    assert after.height == before.height
    assert after["rank"].unique().to_list() == [0]

    # The same query on the old and the new run gives the same numbers (paths respelled).
    def medians(history: pl.DataFrame) -> dict[tuple[str, str], float]:
        found = (
            history.filter(pl.col("signal") == "output", pl.col("metric") == "std")
            .group_by("layer", "tensor_path")
            .agg(pl.col("value").median())
        )
        return {(layer, path): value for layer, path, value in found.iter_rows()}

    assert medians(after) == {
        (layer, modern_path(path)): value for (layer, path), value in medians(before).items()
    }
    assert set(after["tensor_path"].unique()) == {"", "['main']", "['aux'][0]", "['aux'][1]"}

    # result.json: the aggregates 0.8.0 computed (window 3, partial windows), and numpy's.
    old_records = {r["layer"]: r for r in json.loads((old / "result.json").read_text())}
    new_records = {r["layer"]: r for r in json.loads((new / "result.json").read_text())}
    assert list(new_records) == list(old_records)
    compared = 0
    for layer, record in new_records.items():
        assert record["type"] == old_records[layer]["type"].rsplit(".", 1)[-1]
        old_tensors = {
            (t["call_index"], t["signal"], t["tensor_path"]): t
            for t in old_records[layer]["tensors"]
        }
        for tensor in record["tensors"]:
            gradient = tensor["signal"] == "output_gradient"
            key = (
                tensor["call_index"],
                tensor["signal"],
                legacy_path(tensor["tensor_path"], gradient=gradient),
            )
            for metric, stats in tensor["statistics"].items():
                was = old_tensors[key]["statistics"][metric]
                if was["unavailable"]:
                    continue
                assert stats["observations"] == was["observations"]
                for name in (*AGGREGATES, "previous_window_mean", "recent_window_mean"):
                    if was[name] is None:
                        assert stats[name] is None, (layer, key, metric, name)
                    else:
                        assert stats[name] == pytest.approx(was[name], rel=1e-9), (
                            layer,
                            key,
                            metric,
                            name,
                        )
                compared += 1
    assert compared >= 60
    values = (
        before.filter(
            (pl.col("layer") == "head")
            & (pl.col("signal") == "output")
            & (pl.col("metric") == "mean")
        )
        .sort("sample_id")["value"]
        .to_numpy()
    )
    head = next(t for t in new_records["head"]["tensors"] if t["signal"] == "output")
    stats = head["statistics"]["mean"]
    assert len(values) == STEPS + 1  # with the evaluation forward
    assert stats["recent_window_mean"] == pytest.approx(values[-WINDOW:].mean(), rel=1e-12)
    assert stats["previous_window_mean"] == pytest.approx(values[:-WINDOW].mean(), rel=1e-12)
    assert stats["std"] == pytest.approx(np.std(values), rel=1e-12)

    # TensorBoard is left as it was
    (event,) = (old / "tensorboard").iterdir()
    assert (new / "tensorboard" / event.name).read_bytes() == event.read_bytes()


def test_a_killed_0_8_0_run_is_upgraded_from_its_parts(old_runs: Path, tmp_path: Path) -> None:
    killed = old_runs / "killed"
    parts = sorted((killed / "history.parts").glob("*.parquet"))
    rows = sum(pl.read_parquet(p).height for p in parts)
    assert rows > 0
    done = upgrade(killed, tmp_path / "new")
    (run,) = done.runs
    assert run.interrupted
    assert run.history_rows == rows
    assert_artifact_dir_conforms(tmp_path / "new")
    assert main(["validate", str(tmp_path / "new")]) == 0


def test_0_8_0s_own_sinks_run_fed_by_ti_core(tmp_path: Path) -> None:
    """torchinstruments' DirectorySink, given 0.8.0's records rebuilt by ti_core.legacy, writes
    a 0.8.0 run holding every measurement ti-core made; ti upgrade reads it back."""
    from torchinstruments.records import SampleState
    from torchinstruments.sinks import DirectorySink as DirectorySink080

    states: list[bool] = []

    class StateSink:  # compares by identity, as 0.8.0's own code does
        def initialize(self, run: Any, modules: Any) -> None:
            pass

        def observe(self, sample: Any) -> None:
            states.append(sample.state is SampleState.FORWARD_COMPLETE)

        def close(self) -> None:
            pass

    torch.manual_seed(0)
    model = Net()
    memory = MemorySink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_observer(
            model,
            output_dir=None,
            sink=[DirectorySink080(tmp_path / "old"), StateSink(), memory],
            sampler=AlwaysSampler(),
        )
    assert sum(issubclass(w.category, FutureWarning) for w in caught) == 2
    train_steps(model, 2)
    remove_observer(model)
    assert states == [True, False, True, False, True]

    written = pl.read_parquet(tmp_path / "old" / "history.parquet")
    rows = memory.table().to_pylist()
    assert written.height == len(rows)
    by_key = {
        (r[0], r[1], r[2], r[3], r[4], r[5]): r[6]
        for r in written.select(
            "layer", "call_index", "signal", "tensor_path", "sample_id", "metric", "value"
        ).iter_rows()
    }
    for r in rows:
        path = legacy_path(r["tensor_path"], gradient=r["signal"] == "output_gradient")
        key = (r["layer"], r["call_index"], r["signal"], path, r["sample_id"], r["metric"])
        assert by_key[key] == r["value"], key
    upgrade(tmp_path / "old", tmp_path / "new")
    assert_artifact_dir_conforms(tmp_path / "new")
    converted = pl.read_parquet(tmp_path / "new" / "history.parquet")
    assert sorted(converted["tensor_path"].unique()) == sorted({r["tensor_path"] for r in rows})


class _TwoLeaves(torch.nn.Module):
    def __init__(self, direct_leaves: bool) -> None:
        super().__init__()
        self.direct_leaves = direct_leaves
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.direct_leaves:
            return self.b.forward(self.a.forward(x))
        return self.b(self.a(x))


def _entries(history: pl.DataFrame) -> dict[tuple[Any, ...], float]:
    """``{(forward, layer, signal, call): mean}`` of the measured tensors of a run."""
    means = history.filter((pl.col("metric") == "mean") & pl.col("value").is_not_null())
    return {
        (f, layer, signal, call): value
        for f, layer, signal, call, value in means.select(
            "forward_index", "layer", "signal", "call_index", "value"
        ).iter_rows()
    }


@pytest.mark.parametrize("direct_root", [False, True], ids=["model(x)", "model.forward(x)"])
@pytest.mark.parametrize("direct_leaves", [False, True], ids=["leaf(x)", "leaf.forward(x)"])
def test_capture_direct_forwards_records_what_0_8_0_records(
    tmp_path: Path, direct_root: bool, direct_leaves: bool
) -> None:
    got = {}
    for name, inject, remove in (
        ("0.8.0", ti08.inject_observer, ti08.remove_observer),
        ("ti", inject_observer, remove_observer),
    ):
        torch.manual_seed(0)
        model = _TwoLeaves(direct_leaves)
        sampler = ti08.AlwaysSampler() if name == "0.8.0" else AlwaysSampler()
        inject(model, output_dir=tmp_path / name, sampler=sampler, capture_direct_forwards=True)
        for step in range(2):
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(step))
            (model.forward(x) if direct_root else model(x)).sum().backward()
        remove(model)
        got[name] = _entries(pl.read_parquet(tmp_path / name / "history.parquet"))
    assert len(got["0.8.0"]) == 2 * 2 * 2  # 2 forwards x 2 leaves x (output, gradient)
    assert got["ti"].keys() == got["0.8.0"].keys()
    for key, value in got["0.8.0"].items():
        assert got["ti"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("policy", ["warn", "ignore", "raise"])
def test_a_0_8_0_reducer_that_raises_is_handled_at_the_forward_as_0_8_0_did(
    tmp_path: Path, policy: str
) -> None:
    """Both attach; at the forward both warn ("warn"), stay silent ("ignore") or raise the
    reducer's own error ("raise")."""

    def broken(tensor: torch.Tensor) -> dict[str, float]:
        raise RuntimeError("needs 4 features")

    outcomes = {}
    for name, inject, remove, defaults in (
        ("0.8.0", ti08.inject_observer, ti08.remove_observer, ti08.default_reducers()),
        ("ti", inject_observer, remove_observer, ()),
    ):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
        sampler = ti08.AlwaysSampler() if name == "0.8.0" else AlwaysSampler()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # ti's adaptation notice
            inject(
                model,
                output_dir=tmp_path / name,
                sampler=sampler,
                reducers=(*defaults, broken),
                error_policy=policy,
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(3):
                    model(torch.randn(2, 3)).sum().backward()
                raised = None
            except RuntimeError as error:
                raised = str(error)
            remove(model)
        warned = any("needs 4 features" in str(w.message) for w in caught)
        outcomes[name] = (raised, warned)
    assert outcomes["ti"] == outcomes["0.8.0"]
    assert (
        outcomes["ti"]
        == {
            "warn": (None, True),
            "ignore": (None, False),
            "raise": ("needs 4 features", False),
        }[policy]
    )


class _OwnParameter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias


class _LeafOutputs(torch.nn.Module):
    """nn.Identity on the (grad-requiring) input, and a module returning its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.same = torch.nn.Identity()
        self.own = _OwnParameter()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.lin(self.same(x)) * self.own(x)
        return result


def test_leaf_outputs_get_the_gradient_0_8_0_records(tmp_path: Path) -> None:
    got = {}
    for name, inject, remove in (
        ("0.8.0", ti08.inject_observer, ti08.remove_observer),
        ("ti", inject_observer, remove_observer),
    ):
        torch.manual_seed(0)
        model = _LeafOutputs()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = ti08.AlwaysSampler() if name == "0.8.0" else AlwaysSampler()
        inject(model, output_dir=tmp_path / name, sampler=sampler)
        for step in range(3):
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(step))
            x.requires_grad_()
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
        remove(model)
        got[name] = _entries(pl.read_parquet(tmp_path / name / "history.parquet"))
        assert not model.own.bias._backward_hooks
    leaf_gradients = {k for k in got["0.8.0"] if k[1] in ("same", "own") and "grad" in k[2]}
    assert len(leaf_gradients) == 3 * 2  # three steps, two leaf outputs
    assert got["ti"].keys() == got["0.8.0"].keys()
    for key, value in got["0.8.0"].items():
        assert got["ti"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    histograms = pl.read_parquet(tmp_path / "ti" / "histograms.parquet")
    assert {"same", "own"} <= set(
        histograms.filter(pl.col("signal") == "output_gradient").get_column("layer")
    )


def test_live_parts_hold_what_0_8_0_published_per_event_within_seconds(tmp_path: Path) -> None:
    """0.8.0 published a part after each sampled forward and each backward (9 parts, 72 rows
    after four steps of nn.Identity, as docs/migration.md says); here the same entries are in
    history.parts/ seconds later, coalesced into fewer parts, with no further step."""
    import time

    def steps(model: torch.nn.Module) -> None:
        for step in range(4):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
            model(x.requires_grad_()).sum().backward()

    old_model = torch.nn.Sequential(torch.nn.Identity())
    ti08.inject_observer(old_model, output_dir=tmp_path / "old", sampler=ti08.AlwaysSampler())
    steps(old_model)
    old_parts = sorted((tmp_path / "old" / "history.parts").glob("*.parquet"))
    old = pl.concat([pl.read_parquet(p) for p in old_parts])
    assert len([p for p in old_parts if pl.read_parquet(p).height]) == 8  # + one empty at attach
    assert old.height == 72
    ti08.remove_observer(old_model)

    model = torch.nn.Sequential(torch.nn.Identity())
    inject_observer(model, output_dir=tmp_path / "new", sampler=AlwaysSampler())
    try:
        steps(model)
        want = set(old.select("forward_index", "signal").unique().iter_rows())
        deadline = time.monotonic() + 30  # a deadlock guard; the clock publishes after 1 s
        while True:
            parts = sorted((tmp_path / "new" / "history.parts").glob("part-*.parquet"))
            live = pl.concat([pl.read_parquet(p) for p in parts]) if parts else None
            if (
                live is not None
                and set(live.select("forward_index", "signal").unique().iter_rows()) >= want
            ):
                break
            assert time.monotonic() < deadline, "the live rows never appeared"
            time.sleep(0.05)
        assert len(parts) < len(old_parts)
    finally:
        remove_observer(model)
