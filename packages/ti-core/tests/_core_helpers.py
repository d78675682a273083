"""Helpers for ti-core tests: numpy float64 references and row lookups in MemorySink tables."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import settings
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ti_core.reduction import layout

METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")


def examples(n: int) -> int:
    """``n`` Hypothesis examples in the default profile, scaled with the loaded profile's
    ``max_examples`` (x10 under ``properties``; see conftest.py)."""
    return max(1, n * settings.default.max_examples // 100)


def reference(values: Any) -> dict[str, float | None]:
    """The default profile computed with numpy float64 (None where unavailable)."""
    a = np.asarray(values, dtype=np.float64).ravel()
    if a.size == 0:
        return dict.fromkeys(METRICS)
    finite = a[np.isfinite(a)]
    out: dict[str, float | None] = {
        "zero_fraction": float(np.mean(a == 0)),
        "nonfinite_fraction": float(np.mean(~np.isfinite(a))),
    }
    if finite.size == 0:
        out.update(dict.fromkeys(("mean", "std", "min", "max", "p25", "p50", "p75")))
        return out
    out.update(
        mean=float(finite.mean()),
        std=float(finite.std()),
        min=float(finite.min()),
        max=float(finite.max()),
        p25=float(np.percentile(finite, 25)),
        p50=float(np.percentile(finite, 50)),
        p75=float(np.percentile(finite, 75)),
    )
    return out


def rows(table: pa.Table, **where: Any) -> list[dict[str, Any]]:
    """Rows of ``table`` whose columns equal the given values."""
    return [r for r in table.to_pylist() if all(r[k] == v for k, v in where.items())]


def stats(table: pa.Table, **where: Any) -> dict[str, float | None]:
    """``{metric: value}`` of the one tensor matching ``where``; fails if it is not unique."""
    found = rows(table, **where)
    assert found, f"no rows for {where}"
    keys = {
        (r["sample_id"], r["layer"], r["call_index"], r["signal"], r["tensor_path"]) for r in found
    }
    assert len(keys) == 1, f"{where} matches several tensors: {sorted(keys)}"
    return {r["metric"]: r["value"] for r in found}


def assert_matches(
    got: dict[str, float | None], expected: dict[str, float | None], rtol: float = 1e-5
) -> None:
    for metric, want in expected.items():
        value = got[metric]
        if want is None:
            assert value is None, f"{metric}: expected null, got {value}"
        else:
            assert value is not None, f"{metric}: expected {want}, got null"
            np.testing.assert_allclose(value, want, rtol=rtol, atol=1e-7, err_msg=metric)


def hook_state(model: nn.Module) -> list[tuple[str, Any]]:
    """Everything an observer could leave behind on a model, per module."""
    state = []
    for name, module in model.named_modules(remove_duplicate=False):
        state.append(
            (
                name,
                (
                    sorted(module.__dict__),
                    module.__dict__.get("forward"),
                    dict(module._forward_hooks),
                    dict(module._forward_pre_hooks),
                    dict(module._backward_hooks),
                    dict(module._backward_pre_hooks),
                    set(module._forward_hooks_always_called),
                    set(module._forward_hooks_with_kwargs),
                    set(module._forward_pre_hooks_with_kwargs),
                ),
            )
        )
    return state


def op_calls(fn: Callable[[], object], name: str) -> int:
    """How many times ``fn()`` ran the aten operator ``name`` on CPU."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == name)


def exact_row(values: np.ndarray) -> dict[str, float]:
    """The profile row (:mod:`ti_core.reduction.layout` names) of ``values``, from numpy in
    float64; the metrics over finite entries are absent when there are none."""
    a = np.asarray(values, dtype=np.float64).ravel()
    f = a[np.isfinite(a)]
    out = {
        "zero_fraction": np.count_nonzero(a == 0) / a.size,
        "nonfinite_fraction": (a.size - f.size) / a.size,
        "finite_count": float(f.size),
    }
    if f.size:
        mean = math.fsum(f) / f.size
        p25, p50, p75 = np.percentile(f, [25, 50, 75])
        out.update(
            mean=mean,
            std=math.sqrt(math.fsum((f - mean) ** 2) / f.size),
            min=float(f.min()),
            max=float(f.max()),
            p25=float(p25),
            p50=float(p50),
            p75=float(p75),
        )
    return out


def assert_row(row: torch.Tensor | np.ndarray, values: np.ndarray) -> None:
    """A profile row equals :func:`exact_row` of ``values``: order statistics, fractions and
    counts bit for bit, the float64 sums to 1e-12."""
    columns = layout.DEFAULT_LAYOUT.columns
    got = dict(zip(columns, np.asarray(row, dtype=np.float64).tolist(), strict=True))
    want = exact_row(values)
    for name in layout.DEFAULT_LAYOUT.columns:
        if name not in want:
            assert math.isnan(got[name]), name
        elif name in ("mean", "std"):
            assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-300), name
        else:
            assert got[name] == want[name], name  # order statistics, fractions, counts
