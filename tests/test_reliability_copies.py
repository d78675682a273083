"""Copies of an observed model (deepcopy for EMA, pickle, torch.save) are unobserved and run."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    MemorySink,
    has_observer,
    inject_observer,
    remove_observer,
)
from ti_io import DirectorySink, HistoryConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))


def _torch_save(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, nn.Module)
    return loaded


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _torch_save,
}


def _leftovers(model: nn.Module) -> list[tuple[str, int, int, bool, bool]]:
    """Per module: forward hooks, pre-hooks, an instance ``forward``, and whether its
    ``__dict__`` holds keys that a never-observed model of the same build lacks."""
    pristine = {n: set(m.__dict__) for n, m in _model().named_modules()}
    return [
        (
            n,
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            "forward" in m.__dict__,
            bool(set(m.__dict__) - pristine[n]),
        )
        for n, m in model.named_modules()
    ]


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("while_sampling", [True, False])
def test_copy_is_unobserved_runs_and_records_nothing(
    how: str, direct: bool, while_sampling: bool
) -> None:
    model = _model()
    sink = MemorySink()
    # EveryNForwardsSampler(2): after forward 0 the capture is installed, after forward 1 not
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=EveryNForwardsSampler(2),
        capture_direct_forwards=direct,
    )
    x = torch.randn(3, 4)
    model(x).sum().backward()
    if not while_sampling:
        model(x).sum().backward()
    rows = sink.table().num_rows
    clone = COPIES[how](model)

    assert has_observer(model)
    assert not has_observer(clone)
    assert clone.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(clone.state_dict()[key], value)
    for _ in range(3):  # the copy trains like any module and records nothing
        out = clone(x)
        out.sum().backward()
        with torch.no_grad():
            torch.testing.assert_close(out, _plain(clone, x))
    assert sink.table().num_rows == rows
    # whatever the copy inherited is gone after its first forward (or a remove_observer)
    remove_observer(clone)
    assert all(not (f or p or fw or ob) for _, f, p, fw, ob in _leftovers(clone))

    # the original stays observed and keeps recording
    model(x).sum().backward()
    model(x).sum().backward()
    assert sink.table().num_rows > rows
    remove_observer(model)
    assert all(not (f or p or fw or ob) for _, f, p, fw, ob in _leftovers(model))
    assert sink.close_count == 1


def _plain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's output computed without any hook or override: class forwards only."""
    h = x
    for layer in model.children():
        h = type(layer).forward(layer, h)
    return h


def test_ema_copy_of_a_model_writing_to_a_directory(tmp_path: Path) -> None:
    """AveragedModel deep-copies the observed model; the EMA copy neither writes nor shares
    the directory sink, and the run's artifacts hold only the original's rows."""
    model = _model()
    out = tmp_path / "stats"
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=64))
    inject_observer(model, sink=sink, sampler=AlwaysSampler())
    ema = AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    steps = 4
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        ema.update_parameters(model)
        with torch.no_grad():
            ema(x)
    assert not has_observer(ema)
    assert not has_observer(ema.module)
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    saved: dict[str, Any] = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert not any("_ti" in k for k in saved)
    remove_observer(model)
    history = pl.read_parquet(out / "history.parquet")
    assert history.get_column("forward_index").unique().sort().to_list() == list(range(steps))
    assert history.get_column("sample_id").n_unique() == steps
    assert not has_observer(model)


def test_state_dict_and_saved_weights_are_unchanged_by_observing(tmp_path: Path) -> None:
    model = _model()
    before = io.BytesIO()
    torch.save(model.state_dict(), before)
    inject_observer(model, output_dir=None, sink=MemorySink(), sampler=AlwaysSampler())
    model(torch.randn(2, 4))
    during = io.BytesIO()
    torch.save(model.state_dict(), during)
    remove_observer(model)
    a = torch.load(io.BytesIO(before.getvalue()), weights_only=True)
    b = torch.load(io.BytesIO(during.getvalue()), weights_only=True)
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
