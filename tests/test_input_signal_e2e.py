"""The ``input`` signal through the whole path: a real training run written by the directory
sink, finalized, validated, summarized (``ti summary --signal input``), read back with Polars,
and its values checked against numpy float64."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from ti_core import EveryNForwardsSampler, inject_observer, remove_observer
from ti_io import scan_history
from ti_io.cli import main as ti


def test_a_training_run_records_each_modules_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    out = tmp_path / "stats"
    inject_observer(
        model,
        output_dir=out,
        sampler=EveryNForwardsSampler(5),
        signals=("output", "output_gradient", "input"),
    )
    seen: dict[int, np.ndarray] = {}
    handle = model[2].register_forward_pre_hook(
        lambda module, args: seen.__setitem__(len(seen), args[0].detach().double().numpy().copy())
    )
    try:
        for _ in range(20):
            x = torch.randn(32, 6)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        handle.remove()
        remove_observer(model)

    assert ti(["validate", str(out)]) == 0
    history = scan_history(out).filter(pl.col("signal") == "input").collect()
    assert set(history["layer"]) == {"0", "1", "2"}
    assert set(history["tensor_path"]) == {"[0]"}
    assert sorted(set(history["forward_index"])) == [0, 5, 10, 15]
    for forward in (0, 5, 10, 15):
        want = seen[forward]
        got = dict(
            history.filter(pl.col("layer") == "2", pl.col("forward_index") == forward)
            .select("metric", "value")
            .iter_rows()
        )
        assert got["mean"] == pytest.approx(want.mean(), rel=1e-12)
        assert got["std"] == pytest.approx(want.std(), rel=1e-12)
        assert got["min"] == want.min()
        assert got["max"] == want.max()
    result = json.loads((out / "result.json").read_text())
    head = next(layer for layer in result if layer["layer"] == "2")
    signals = [t["signal"] for t in head["tensors"]]
    assert signals == ["output", "output_gradient", "input"]
    assert head["tensors"][-1]["statistics"]["mean"]["observations"] == 4
    capsys.readouterr()
    assert ti(["summary", str(out), "--signal", "input"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if "┆ input" in line]
    assert {line.split("┆")[0].strip("│ ") for line in rows} == {"0", "1", "2"}
    assert not [line for line in lines if "┆ output" in line]
