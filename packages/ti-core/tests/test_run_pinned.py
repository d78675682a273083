"""A whole run's tables pinned: every column of every row, for a model that exercises capture.

The model has what the capture path treats specially: a chain of ``nn.Identity`` passing one
tensor on (one reduction, many rows), a module called twice per forward, tuple and dict
outputs, an output that is a leaf (its gradient hooked on the leaf), a ``no_grad`` call, an
eval-mode forward and a forward without backward. ``data/run_pinned.json`` holds the rows
of an implementation checked against the numpy float64 references (floats as ``float.hex``;
``run_id`` and ``timestamp`` left out, they differ between runs). Regenerate only from an
implementation you mean to pin (``python packages/ti-core/tests/test_run_pinned.py --write``).

Every tensor of the run is exact in float32 whatever the CPU: parameters and inputs are small
multiples of 1/8 and 1/4, and the model uses only additions, products, ReLU and clamping, so
matrix products give the same bits whichever kernel (AVX2, AVX-512, ...) torch dispatches to.
The pins therefore compare the capture and reduction, not the machine's BLAS.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, observer_of, remove_observer

PINNED = Path(__file__).parent / "data" / "run_pinned.json"
LEFT_OUT = ("run_id", "timestamp")


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.detach()


class Named(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": torch.clamp(x, -1.0, 1.0), "n": (x > 0).sum(dim=-1)}


class Param(nn.Module):
    """Returns its parameter unchanged: a leaf output, its gradient hooked on the parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 6).reshape(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.chain = nn.Sequential(*[nn.Identity() for _ in range(5)])
        self.act = nn.ReLU()
        self.pair = Pair()
        self.named = Named()
        self.param = Param()
        self.frozen = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.chain(self.inp(x))
        h = self.act(h) + self.act(-h)  # one module, two calls
        a, b = self.pair(h)
        d = self.named(a)
        with torch.no_grad():
            frozen = self.frozen(b)
        w = self.param(x)
        return self.out(d["h"] + frozen) + w.sum()


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return value.hex() if math.isfinite(value) else repr(value)
    if isinstance(value, list):
        return [_cell(v) for v in value]
    return value


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    kept = table.drop_columns([c for c in LEFT_OUT if c in table.column_names])
    return [{k: _cell(v) for k, v in row.items()} for row in kept.to_pylist()]


def measured(error_policy: str) -> dict[str, list[dict[str, Any]]]:
    """The history and histogram rows of a short deterministic training run."""
    torch.manual_seed(5)
    model = Net()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():  # exact in float32 on any CPU (module docstring)
        for p in model.parameters():
            p.copy_(torch.randint(-4, 5, p.shape, generator=g).float() / 8)
    xs = [torch.randint(-8, 9, (4, 3), generator=g).float() / 4 for _ in range(4)]
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        max_histogram_modules=4,
        error_policy=error_policy,
    )
    try:
        model(xs[0]).square().mean().backward()
        model(xs[1]).sum().backward()
        model(xs[2])  # never backwarded
        model.eval()
        with torch.no_grad():
            model(xs[3])
        observer = observer_of(model)
        assert observer is not None
        observer.drain()
        history, histograms = sink.table(), sink.histograms()
    finally:
        remove_observer(model)
    return {"history": _rows(history), "histograms": _rows(histograms)}


@pytest.mark.parametrize("error_policy", ["warn", "raise"], ids=["worker", "inline"])
def test_run_equals_the_pinned_rows(error_policy: str) -> None:
    pinned = json.loads(PINNED.read_text())
    got = measured(error_policy)
    for table in ("history", "histograms"):
        assert len(got[table]) == len(pinned[table]), table
        for i, (row, want) in enumerate(zip(got[table], pinned[table], strict=True)):
            assert row == want, (table, i)


def test_the_pinned_run_covers_what_it_claims() -> None:
    """Guards the pins against a model that no longer exercises the special cases."""
    history = json.loads(PINNED.read_text())["history"]
    mean_rows = [r for r in history if r["metric"] == "mean"]
    assert {r["sample_id"] for r in mean_rows} == {0, 1, 2, 3}
    chain = [r for r in mean_rows if r["layer"].startswith("chain.") and r["sample_id"] == 0]
    assert len({(r["signal"], r["layer"]) for r in chain}) == 10  # 5 outputs, 5 gradients
    assert {r["call_index"] for r in mean_rows if r["layer"] == "act"} == {0, 1}
    assert {r["tensor_path"] for r in mean_rows if r["layer"] == "named"} == {"['h']", "['n']"}
    assert {r["tensor_path"] for r in mean_rows if r["layer"] == "pair"} == {"[0]", "[1]"}
    leaf = [r for r in mean_rows if r["layer"] == "param" and r["signal"] == "output_gradient"]
    assert {r["sample_id"] for r in leaf} == {0, 1}  # the two forwards that had a backward
    assert all(r["value"] is not None for r in leaf)
    assert {r["grad_enabled"] for r in mean_rows if r["layer"] == "frozen"} == {False}
    assert {r["mode"] for r in mean_rows if r["sample_id"] == 3} == {"eval"}
    late = [r for r in mean_rows if r["sample_id"] >= 2 and r["signal"] == "output_gradient"]
    assert not late  # no backward reached them
    assert np.isfinite([float.fromhex(r["value"]) for r in mean_rows if r["value"]]).all()


def write_pins() -> None:
    """Regenerate ``data/run_pinned.json`` from the implementation installed now."""
    got = measured("raise")
    assert got == measured("warn"), "worker and inline rows differ: nothing to pin"
    PINNED.parent.mkdir(exist_ok=True)
    PINNED.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
    print(f"wrote {PINNED} ({len(got['history'])} + {len(got['histograms'])} rows)")


if __name__ == "__main__":  # pragma: no cover - the pins' generator, run by hand
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(f"usage: python {Path(__file__).name} --write")
    write_pins()
