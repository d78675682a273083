"""Rows pinned bit for bit: what the observer writes for a fixed set of tensors never changes.

The set spans the reduction engine's paths (batched small tensors in padded matrices, one-pass
large tensors, every supported dtype, NaN/inf mixes, ties, all-equal, empty, one element) and
is measured end to end: module outputs captured by a real observer, reduced on the emission
worker and inline, read back from a ``MemorySink``. Two references:

- ``data/reduction_pinned.json``: the rows the implementation before the sampled-step
  optimizations for many small modules (benchmarks/README.md) produced for the same tensors
  (value and histogram floats as ``float.hex``). A change of the engine must keep every bit;
  regenerate only from an implementation you mean to pin
  (``python packages/ti-core/tests/test_reduction_pinned.py --write``).
- numpy in float64 on the same values, independently: order statistics, fractions and
  histogram counts and edges exactly, mean and std to float64 rounding.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _core_helpers import METRICS, reference
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, observer_of, remove_observer

PINNED = Path(__file__).parent / "data" / "reduction_pinned.json"
BINS = 30


def _normal(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n)


def _with(a: np.ndarray, seed: int, **fractions: float) -> np.ndarray:
    """``a`` with a share of its entries replaced by NaN / +inf / -inf / 0.0 / -0.0."""
    values = {"nan": math.nan, "pinf": math.inf, "ninf": -math.inf, "zero": 0.0, "negzero": -0.0}
    rng = np.random.default_rng(seed)
    out = a.copy()
    for name, share in fractions.items():
        out[rng.random(out.size) < share] = values[name]
    return out


def cases() -> dict[str, torch.Tensor]:
    """The pinned tensors, by name (deterministic: numpy's PCG64 streams, fixed seeds)."""
    f32, f64 = torch.float32, torch.float64
    out: dict[str, torch.Tensor] = {}

    def add(name: str, values: np.ndarray | list[float], dtype: torch.dtype) -> None:
        out[name] = torch.from_numpy(np.asarray(values, dtype=np.float64)).to(dtype)

    for n in (1, 2, 3, 5, 8, 17, 100, 1000, 4097, 8191, 8192, 8193, 32768, 65536, 65537):
        add(f"f32_normal_{n}", _normal(n, n), f32)
    add("f32_normal_200003", _normal(200_003, 3), f32)
    out["f32_seq_2x128x128"] = torch.from_numpy(_normal(32768, 11)).to(f32).reshape(2, 128, 128)
    add("f32_equal_1000", np.full(1000, 1.5), f32)
    add("f32_equal_70000", np.full(70_000, -2.25), f32)
    add("f32_zeros_signed_5000", _with(_normal(5000, 5), 6, zero=0.3, negzero=0.3), f32)
    add("f32_relu_70000", np.maximum(_normal(70_000, 7), 0.0), f32)
    add("f32_relu_9000", np.maximum(_normal(9000, 8), 0.0), f32)
    add("f32_nan_1000", _with(_normal(1000, 9), 10, nan=0.1), f32)
    add("f32_nan_40000", _with(_normal(40_000, 9), 10, nan=0.02), f32)
    add("f32_nan_inf_70000", _with(_normal(70_000, 12), 13, nan=0.01, pinf=0.01, ninf=0.01), f32)
    add("f32_inf_3000", _with(_normal(3000, 14), 15, pinf=0.05, ninf=0.05), f32)
    add("f32_all_nan_50", np.full(50, math.nan), f32)
    add("f32_all_inf_10", [math.inf] * 5 + [-math.inf] * 5, f32)
    add("f32_huge_1000", _normal(1000, 16) * 1e30, f32)
    add("f32_shifted_20000", 1e4 + _normal(20_000, 17) * 1e-3, f32)
    add("f32_shifted_100000", 1e4 + _normal(100_000, 18) * 1e-3, f32)
    add("f32_subnormal_300", _normal(300, 19) * 1e-42, f32)
    add("f32_two_values_70000", np.where(_normal(70_000, 20) > 0, 1.0, 3.0), f32)
    add("f32_one_3", [3.0], f32)
    out["f32_empty"] = torch.zeros(0, dtype=f32)
    out["f32_empty_3x0"] = torch.zeros(3, 0, dtype=f32)
    for n in (7, 1000, 70_000):
        add(f"f64_normal_{n}", _normal(n, 100 + n), f64)
    add("f64_nan_inf_9000", _with(_normal(9000, 21), 22, nan=0.05, pinf=0.02), f64)
    add("f64_near_max_10", np.linspace(1e307, 1.7e308, 10), f64)
    add("f64_shifted_5000", 1e9 + _normal(5000, 23), f64)
    for n in (100, 5000, 70_000):
        add(f"f16_normal_{n}", _normal(n, 200 + n) * 50, torch.float16)
    add("f16_inf_2000", _with(_normal(2000, 24) * 50, 25, pinf=0.01, nan=0.01), torch.float16)
    for n in (100, 70_000):
        add(f"bf16_normal_{n}", _normal(n, 300 + n) * 1e3, torch.bfloat16)
    for dtype, lo, hi in (
        (torch.int8, -128, 128),
        (torch.uint8, 0, 256),
        (torch.int16, -(2**15), 2**15),
        (torch.int32, -(2**31), 2**31),
        (torch.int64, -(2**62), 2**62),
    ):
        name = str(dtype).removeprefix("torch.")
        for n in (100, 70_000):
            ints = np.random.default_rng(n + lo % 97).integers(lo, hi, n, dtype=np.int64)
            out[f"{name}_{n}"] = torch.from_numpy(ints).to(dtype)
    out["int64_beyond_2_53_5"] = torch.tensor([2**53 + 1, -(2**53) - 3, 7, 2**60, 0])
    out["int64_one_1"] = torch.tensor([42])
    for n in (1000, 70_000):
        out[f"bool_{n}"] = torch.from_numpy(_normal(n, 400 + n) > 0.3)
    return out


class Emitter(nn.Module):
    """Returns its fixed tensor: every case is one layer's output."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tensor


class Emitters(nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Emitter(t) for t in tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            layer(x)
        return x


def _hex(value: float | None) -> str | None:
    return None if value is None else float(value).hex()


def measured(error_policy: str) -> dict[str, dict[str, Any]]:
    """Every case's rows as the observer writes them, by case name (one sample)."""
    named = cases()
    model = Emitters(list(named.values()))
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        max_histogram_modules=len(named),
        error_policy=error_policy,  # "warn": the emission worker; "raise": inline
    )
    try:
        observer = observer_of(model)
        assert observer is not None
        model(torch.zeros(1))
        observer.drain()
        history, histograms = sink.table(), sink.histograms()
    finally:
        remove_observer(model)
    layer_names = [f"layers.{i}" for i in range(len(named))]
    got: dict[str, dict[str, Any]] = {name: {"history": {}} for name in named}
    by_layer = dict(zip(layer_names, named, strict=True))
    for row in history.to_pylist():
        case = got[by_layer[row["layer"]]]
        assert row["metric"] not in case["history"], f"{row['layer']}: {row['metric']} twice"
        case["history"][row["metric"]] = [_hex(row["value"]), row["unavailable_reason"]]
    for row in histograms.to_pylist():
        case = got[by_layer[row["layer"]]]
        assert "histogram" not in case, f"{row['layer']}: two histograms"
        case["histogram"] = {
            "bucket_limits": [_hex(v) for v in row["bucket_limits"]],
            "bucket_counts": list(row["bucket_counts"]),
            **{k: _hex(row[k]) for k in ("min", "max", "sum", "sum_squares")},
            "num": row["num"],
            "nonfinite_count": row["nonfinite_count"],
        }
    return got


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PINNED.read_text())
    return data


# The pins were written under numpy 2. numpy 1.x adds float64 arrays in another order, so under
# it the sums (mean, std, a histogram's sum and sum of squares) may differ in the last bits
# (seen: 2-4 ulp on f64_nan_inf_9000 and f64_normal_70000 with numpy 1.26, the floor); they
# are then held to float64 rounding, and every other value still to the bit.
PINNED_NUMPY_MAJOR = 2
SUMS = {"history": ("mean", "std"), "histogram": ("sum", "sum_squares")}


def _close(got: str | None, pinned: str | None) -> bool:
    a, b = _float(got), _float(pinned)
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-13, abs_tol=0.0)


def _equal_up_to_sums(got: dict[str, Any], pinned: dict[str, Any]) -> list[str]:
    """The fields of one case that differ: sums beyond float64 rounding, anything else at all."""
    differ = [section for section in pinned if set(got.get(section, {})) != set(pinned[section])]
    for section, values in pinned.items():
        for key, expected in values.items():
            mine = got.get(section, {}).get(key)
            if key not in SUMS.get(section, ()):
                same = mine == expected
            elif section == "history":
                same = mine is not None and mine[1] == expected[1] and _close(mine[0], expected[0])
            else:
                same = _close(mine, expected)
            if not same:
                differ.append(f"{section}.{key}")
    return differ


@pytest.mark.parametrize("error_policy", ["warn", "raise"], ids=["worker", "inline"])
def test_rows_equal_the_pinned_rows_bit_for_bit(pinned: dict[str, Any], error_policy: str) -> None:
    got = measured(error_policy)
    assert sorted(got) == sorted(pinned)
    exact_sums = int(np.__version__.split(".")[0]) == PINNED_NUMPY_MAJOR
    for name, expected in pinned.items():
        if exact_sums:
            assert got[name] == expected, name
        else:
            assert sorted(got[name]) == sorted(expected), name
            assert _equal_up_to_sums(got[name], expected) == [], name


def _float(value: str | None) -> float | None:
    return None if value is None else float.fromhex(value)


def test_pinned_rows_match_numpy_float64() -> None:
    """The pins themselves are right: numpy float64 on the same values, independently."""
    pins = json.loads(PINNED.read_text())
    exact = ("min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")
    for name, tensor in cases().items():
        values = tensor.to(torch.float64).numpy().ravel()
        with np.errstate(over="ignore"):  # f64_near_max_10: the mean overflows, a null
            want = reference(values)
        history = pins[name]["history"]
        assert set(history) == set(METRICS), name
        for metric in METRICS:
            got = _float(history[metric][0])
            expected = want[metric]
            finite = values[np.isfinite(values)]
            if expected is not None and not math.isfinite(expected):
                expected = None  # overflow in float64: an explained null
            if expected is None:
                assert got is None, (name, metric)
                assert history[metric][1], (name, metric, "a null needs a reason")
            elif metric in exact:
                assert got == expected, (name, metric, got, expected)
            else:
                spread = float(np.max(np.abs(finite - finite.mean()))) if finite.size else 0.0
                tol = 1e-13 * max(abs(expected), spread, np.finfo(np.float64).tiny)
                assert got is not None, (name, metric)
                assert abs(got - expected) <= tol, (name, metric, got, expected)
        hist = pins[name].get("histogram")
        assert hist is not None, name
        finite = values[np.isfinite(values)]
        assert hist["num"] == finite.size, name
        assert hist["nonfinite_count"] == values.size - finite.size, name
        if finite.size == 0:
            assert hist["bucket_counts"] == [], name
            assert hist["min"] is None, name
            continue
        lo, hi = float(finite.min()), float(finite.max())
        assert (_float(hist["min"]), _float(hist["max"])) == (lo, hi), name
        if lo == hi:
            assert hist["bucket_counts"] == [finite.size], name
            continue
        edges = np.linspace(lo, hi, BINS + 1)
        counts, _ = np.histogram(finite, bins=edges)
        assert hist["bucket_counts"] == counts.tolist(), name
        assert [_float(v) for v in hist["bucket_limits"]] == edges[1:].tolist(), name


def write_pins() -> None:
    """Regenerate ``data/reduction_pinned.json`` from the implementation installed now."""
    got = measured("raise")
    assert got == measured("warn"), "worker and inline rows differ: nothing to pin"
    PINNED.parent.mkdir(exist_ok=True)
    PINNED.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED} ({len(got)} cases)")


if __name__ == "__main__":  # pragma: no cover - the pins' generator, run by hand
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(f"usage: python {Path(__file__).name} --write")
    write_pins()
