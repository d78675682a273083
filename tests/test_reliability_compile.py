"""torch.compile: an observer before or after compile trains and records what eager records.

Compile on CPU is slow, so these tests use a tiny model and the ``aot_eager`` backend (dynamo
tracing and AOT autograd, without inductor code generation); docs/reliability.md says so.
"""

from __future__ import annotations

import copy
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


def test_graph_breaks_are_counted_only_where_documented() -> None:
    """Each hook run while compiling is a ``torch.compiler.disable`` graph break; unsampled
    compiled forwards carry only the two root hooks (docs/reliability.md states the counts)."""
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(3, 5)

    torch._dynamo.reset()
    inject_observer(model, output_dir=None, sink=MemorySink(), sampler=EveryNForwardsSampler(1))
    try:
        sampled = torch._dynamo.explain(model)(x)
    finally:
        remove_observer(model)
    torch._dynamo.reset()
    plain = torch._dynamo.explain(model)(x)
    assert plain.graph_break_count == 0
    # a sampled forward: the root pre/post hooks and one hook per selected module run eagerly
    assert 0 < sampled.graph_break_count <= 2 + len(LEAVES)
    reasons = " ".join(str(r.reason) for r in sampled.break_reasons)
    assert "_orig_mod" not in reasons
