"""torch.compile: an observer before or after compile trains and records what eager records.

The fast checks here use a tiny model and the ``aot_eager`` backend (Dynamo tracing and AOT
autograd, without inductor code generation) and read the run back from its files; the inductor
tests, fullgraph included, are ti-core's (packages/ti-core/tests/test_compiled.py).
docs/reliability.md says so.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
import torch._dynamo
from torch import nn

from ti_core import (
    EveryNForwardsSampler,
    MemorySink,
    has_observer,
    inject_observer,
    remove_observer,
)
from ti_schema.testing import load_strict_json

pytestmark = pytest.mark.slow

BACKEND = "aot_eager"
STEPS = 4


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


LEAVES = {"encoder.0", "encoder.1", "head"}


def _train(target: nn.Module, params: nn.Module) -> list[torch.Tensor]:
    """A few real SGD steps; returns the parameters after each step."""
    gen = torch.Generator().manual_seed(7)
    opt = torch.optim.SGD(params.parameters(), lr=0.1)
    after = []
    for _ in range(STEPS):
        x = torch.randn(4, 5, generator=gen)
        y = torch.randn(4, 2, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(target(x), y).backward()
        opt.step()
        after.append(torch.cat([p.detach().flatten().clone() for p in params.parameters()]))
    return after


def _run(base: nn.Module, mode: str, sink: Any = None, output_dir: Path | None = None) -> Any:
    """Train a copy of ``base``; ``mode``: eager, compile-first (observe the OptimizedModule)
    or inject-first (compile the observed module). Returns (sink, params after each step)."""
    model = copy.deepcopy(base)
    options: dict[str, Any] = {"sampler": EveryNForwardsSampler(2)}
    if output_dir is not None:
        options["output_dir"] = output_dir
    else:
        options["sink"] = sink if sink is not None else MemorySink()
        options["output_dir"] = None  # in memory only
    torch._dynamo.reset()
    if mode == "eager":
        target: nn.Module = model
        inject_observer(model, **options)
        observed = model
    elif mode == "compile-first":
        target = torch.compile(model, backend=BACKEND)  # type: ignore[assignment]
        inject_observer(target, **options)
        observed = target
    else:
        inject_observer(model, **options)
        target = torch.compile(model, backend=BACKEND)  # type: ignore[assignment]
        observed = model
    assert has_observer(observed)
    try:
        params = _train(target, model)
    finally:
        remove_observer(observed)
    assert not has_observer(observed)
    return options.get("sink"), params


def _keyed(table: Any) -> dict[tuple[Any, ...], float | None]:
    return {
        (r["forward_index"], r["layer"], r["call_index"], r["signal"], r["metric"]): r["value"]
        for r in table.to_pylist()
    }


def _assert_same_statistics(got: dict[Any, Any], want: dict[Any, Any]) -> None:
    assert got.keys() == want.keys()
    keys = sorted(want, key=repr)
    g = np.array([np.nan if got[k] is None else got[k] for k in keys])
    w = np.array([np.nan if want[k] is None else want[k] for k in keys])
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_compile_before_or_after_inject_trains_and_records_like_eager() -> None:
    torch.manual_seed(0)
    base = Tiny()
    eager_sink, eager_params = _run(base, "eager")
    eager = _keyed(eager_sink.table())
    assert {k[1] for k in eager} == LEAVES
    assert {k[0] for k in eager} == {0, 2}  # EveryNForwardsSampler(2) over 4 steps
    assert {k[3] for k in eager} == {"output", "output_gradient"}
    for mode in ("compile-first", "inject-first"):
        sink, params = _run(base, mode)
        _assert_same_statistics(_keyed(sink.table()), eager)
        for a, b in zip(params, eager_params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_observing_the_optimized_module_reports_original_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = Tiny()
    out = tmp_path / "stats"
    _run(base, "compile-first", output_dir=out)
    history = pl.read_parquet(out / "history.parquet")
    layers = set(history.get_column("layer").unique())
    assert layers == LEAVES
    assert not any("_orig_mod" in name for name in layers)
    records = load_strict_json(out / "result.json")
    assert {r["layer"] for r in records} == LEAVES
    assert "_orig_mod" not in (out / "index.md").read_text()
    # the compiled model itself is untouched by removal: no observer state on either object
    compiled = torch.compile(copy.deepcopy(base), backend=BACKEND)
    sink = MemorySink()
    inject_observer(compiled, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(1))
    assert has_observer(compiled)
    assert not has_observer(compiled._orig_mod)  # type: ignore[arg-type]
    remove_observer(compiled)
    assert not compiled._orig_mod._forward_hooks  # type: ignore[union-attr]
    assert not compiled._orig_mod._forward_pre_hooks  # type: ignore[union-attr]


def test_an_observed_compiled_forward_has_no_graph_break() -> None:
    """The observer's hooks are traced into the graph (docs/reliability.md): a sampled forward
    of an observed model compiles to one graph, as the bare model does."""
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(3, 5)

    torch._dynamo.reset()
    plain = torch._dynamo.explain(model)(x)
    torch._dynamo.reset()
    inject_observer(model, output_dir=None, sink=MemorySink(), sampler=EveryNForwardsSampler(1))
    try:
        sampled = torch._dynamo.explain(model)(x)
    finally:
        remove_observer(model)
    assert plain.graph_break_count == 0
    assert (sampled.graph_count, sampled.graph_break_count) == (plain.graph_count, 0)


def test_hf_model_output_in_a_fullgraph_compile_records_like_eager() -> None:
    """A ``ModelOutput`` returned inside a ``fullgraph=True`` graph: the same rows as eager
    (``['logits']`` / ``['hidden']`` paths, outputs and gradients), the tapped tensors put back
    into the ModelOutput in place."""
    from transformers.utils import ModelOutput as model_output  # noqa: N813  (tests/ has every extra)

    @dataclasses.dataclass
    class Output(model_output):  # type: ignore[misc,valid-type]
        logits: torch.Tensor | None = None
        hidden: torch.Tensor | None = None

    class HFStyle(nn.Module):
        """A child returning a Hugging Face ``ModelOutput`` (a dict and a dataclass at once)."""

        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(5, 6)
            self.head = nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> Any:
            hidden = torch.tanh(self.body(x))
            return Output(logits=self.head(hidden), hidden=hidden)

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = HFStyle()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.model(x)
            return out.logits.sum() + out["hidden"].mean()

    torch.manual_seed(0)
    base = Root()
    x = torch.randn(4, 5)

    def run(compiled: bool) -> dict[tuple[Any, ...], float | None]:
        model = copy.deepcopy(base)
        sink = MemorySink()
        torch._dynamo.reset()
        target: Any = torch.compile(model, backend=BACKEND, fullgraph=True) if compiled else model
        inject_observer(
            target,
            output_dir=None,
            sink=sink,
            sampler=EveryNForwardsSampler(1),
            selector=lambda name, m: name in ("model", "model.head"),
        )
        try:
            target(x).backward()
        finally:
            remove_observer(target)
        return {
            (r["layer"], r["tensor_path"], r["signal"], r["metric"], r["unavailable_reason"]): r[
                "value"
            ]
            for r in sink.table().to_pylist()
        }

    eager = run(False)
    assert {(k[0], k[1]) for k in eager} == {
        ("model", "['logits']"),
        ("model", "['hidden']"),
        ("model.head", ""),
    }
    assert all(k[4] is None for k in eager)
    compiled = run(True)
    _assert_same_statistics(compiled, eager)
