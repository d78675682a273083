"""Property tests of the reducers against numpy float64, beyond test_reducers.py's property test.

test_reducers.py draws one dtype per example with random non-finite rates. Here: mixed dtypes in
one reduction call, structured NaN/Inf patterns (all NaN, one sign of infinity, one finite value
among non-finite ones, constants), values near each dtype's largest finite value, non-contiguous
views, and the same properties end to end through an observed module and a MemorySink.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _core_helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, remove_observer
from ti_core.reduction import Measurements, ReductionPlan, default_reducers
from ti_schema import DEFAULT_METRICS

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64)
DTYPES = (*FLOATS, *INTS, torch.bool)
FINITE_METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75")
PATTERNS = ("random", "all_nan", "all_posinf", "all_neginf", "one_finite", "constant", "huge")


def reference(t: torch.Tensor) -> dict[str, float | None]:
    a = t.detach().to(torch.float64).numpy().ravel()
    if a.size == 0:
        return dict.fromkeys(DEFAULT_METRICS)
    finite = a[np.isfinite(a)]
    out: dict[str, float | None] = {
        "zero_fraction": float(np.count_nonzero(a == 0) / a.size),
        "nonfinite_fraction": float((a.size - finite.size) / a.size),
    }
    if finite.size == 0:
        out.update(dict.fromkeys(FINITE_METRICS))
        return out
    p25, p50, p75 = np.percentile(finite, [25, 50, 75])
    out.update(
        mean=float(finite.mean()),
        std=float(finite.std()),
        min=float(finite.min()),
        max=float(finite.max()),
        p25=float(p25),
        p50=float(p50),
        p75=float(p75),
    )
    return out


def check(got: dict[str, float | None], t: torch.Tensor) -> None:
    ref = reference(t)
    a = t.detach().to(torch.float64).numpy().ravel()
    finite = a[np.isfinite(a)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
    for name, want in ref.items():
        value = got[name]
        if want is None:
            assert value is None, (name, value, t.dtype)
        else:
            assert value is not None, (name, t.dtype, tuple(t.shape))
            assert math.isfinite(value), (name, value, t.dtype)
            assert value == pytest.approx(want, rel=1e-5, abs=1e-12 * scale), (
                name,
                t.dtype,
                tuple(t.shape),
            )


def from_measurements(m: Measurements, i: int) -> dict[str, float | None]:
    return {
        name: float(m.values[i, j]) if m.available[i, j] else None
        for j, name in enumerate(m.names if hasattr(m, "names") else DEFAULT_METRICS)
        if name in DEFAULT_METRICS
    }


def make(
    gen: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...], pattern: str
) -> torch.Tensor:
    size = math.prod(shape)
    if dtype == torch.bool:
        return torch.from_numpy(gen.random(size) < 0.4).reshape(shape)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        if pattern == "huge":
            vals = gen.choice([info.min, info.max, 0], size=size)
        else:
            vals = gen.integers(max(info.min, -500), min(info.max, 500) + 1, size=size)
        return torch.from_numpy(np.asarray(vals, dtype=np.int64)).to(dtype).reshape(shape)
    # float64's own extremes would overflow the float64 reference itself
    largest = min(torch.finfo(dtype).max, 1e150)
    vals = gen.normal(gen.normal() * 4, abs(gen.normal()) + 0.05, size=size)
    if pattern == "all_nan":
        vals[:] = np.nan
    elif pattern == "all_posinf":
        vals[:] = np.inf
    elif pattern == "all_neginf":
        vals[:] = -np.inf
    elif pattern == "one_finite":
        vals[:] = gen.choice([np.nan, np.inf, -np.inf], size=size)
        if size:
            vals[gen.integers(size)] = gen.normal()
    elif pattern == "constant":
        vals[:] = vals[0] if size else 0.0
    elif pattern == "huge":
        # extreme finite values: sums and squares overflow a half or single precision dtype
        vals = gen.choice([largest, -largest, largest / 2, 0.0], size=size)
    t = torch.from_numpy(np.asarray(vals, dtype=np.float64)).to(dtype).reshape(shape)
    return t


tensor_specs = st.tuples(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
    st.sampled_from(PATTERNS),
)


@settings(max_examples=examples(40), deadline=None)
@given(specs=st.lists(tensor_specs, min_size=1, max_size=6), seed=st.integers(0, 2**32 - 1))
def test_mixed_dtypes_and_nonfinite_patterns_in_one_call(
    specs: list[tuple[torch.dtype, tuple[int, ...], str]], seed: int
) -> None:
    gen = np.random.default_rng(seed)
    tensors = [make(gen, d, s, p) for d, s, p in specs]
    m = ReductionPlan(default_reducers()).reduce(tensors)
    assert not m.errors
    assert m.values.shape == (len(tensors), len(DEFAULT_METRICS))
    for i, t in enumerate(tensors):
        check(from_measurements(m, i), t)
        if t.numel() == 0:
            assert all(r and "empty" in r for r in m.reasons[i])


@settings(max_examples=examples(30), deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    step=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_non_contiguous_views_match_their_values(
    dtype: torch.dtype, rows: int, cols: int, step: int, seed: int
) -> None:
    gen = np.random.default_rng(seed)
    base = make(gen, dtype, (rows, cols * step), "random")
    views = [base.t(), base[:, ::step], base.t()[::step], base.expand(2, *base.shape)]
    m = ReductionPlan(default_reducers()).reduce(views)
    assert not m.errors
    for i, v in enumerate(views):
        check(from_measurements(m, i), v.contiguous())


class Emit(nn.Module):
    """Returns the tensors it is given (as computed values, so they are non-leaf outputs)."""

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x.clone() for x in xs]


@settings(max_examples=examples(15), deadline=None)
@given(specs=st.lists(tensor_specs, min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_end_to_end_rows_match_numpy(
    specs: list[tuple[torch.dtype, tuple[int, ...], str]], seed: int
) -> None:
    gen = np.random.default_rng(seed)
    tensors = [make(gen, d, s, p) for d, s, p in specs]
    model = nn.Sequential(Emit())
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    try:
        model(tensors)
    finally:
        remove_observer(model)
    got: dict[str, dict[str, float | None]] = {}
    dtypes: dict[str, str] = {}
    for r in sink.table().to_pylist():
        got.setdefault(r["tensor_path"], {})[r["metric"]] = r["value"]
        dtypes[r["tensor_path"]] = r["dtype"]
        assert (r["value"] is None) == (r["unavailable_reason"] is not None)
    assert sorted(got) == sorted(f"[{i}]" for i in range(len(tensors)))
    for i, t in enumerate(tensors):
        check(got[f"[{i}]"], t)
        assert dtypes[f"[{i}]"] == str(t.dtype).removeprefix("torch.")


# -- large tensors: the selection and histogram paths above the batching threshold ------------

LARGE = (1 << 16) + 1
"""Smallest size reduced alone, by selection (ti_core.reduction.plan's threshold is 1 << 16)."""
NONFINITE_RATES = (0.0, 1e-4, 0.3, 0.999, 1.0)


def large(gen: np.random.Generator, dtype: torch.dtype, size: int, rate: float) -> torch.Tensor:
    """A large tensor: heavy-tailed values, ties (rounded copies), and a share ``rate`` of
    NaN/+inf/-inf entries at random places."""
    if dtype == torch.bool:
        return torch.from_numpy(gen.random(size) < 0.4)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        vals = gen.integers(max(info.min, -1000), min(info.max, 1000) + 1, size=size)
        return torch.from_numpy(vals.astype(np.int64)).to(dtype)
    vals = gen.standard_t(3, size) * abs(gen.normal() * 5) + gen.normal() * 10
    vals[gen.random(size) < 0.2] = np.round(vals[0])  # a block of ties
    specials = gen.random(size) < rate
    vals[specials] = gen.choice([np.nan, np.inf, -np.inf], size=int(specials.sum()))
    return torch.from_numpy(vals).to(dtype)


@settings(max_examples=examples(25), deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3),
    extra=st.integers(0, 3 * (1 << 16)),
    rate=st.sampled_from(NONFINITE_RATES),
    seed=st.integers(0, 2**32 - 1),
)
def test_large_tensors_match_numpy(
    dtypes: list[torch.dtype], extra: int, rate: float, seed: int
) -> None:
    """Sizes from just above the threshold to ~4x it (both sides of the sort limit), every
    dtype, NaN/inf mixes from none to all, next to a small tensor in the same call."""
    gen = np.random.default_rng(seed)
    tensors = [large(gen, d, LARGE + extra + i, rate) for i, d in enumerate(dtypes)]
    tensors.append(make(gen, torch.float32, (3, 5), "random"))
    assert all(t.numel() > (1 << 16) for t in tensors[:-1])
    m = ReductionPlan(default_reducers()).reduce(tensors)
    assert not m.errors
    for i, t in enumerate(tensors):
        check(from_measurements(m, i), t)
