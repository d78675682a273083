"""The torch engine (``torch_select``, ``torch_rows``) held to numpy float64 bit for bit.

The accelerator engine runs on any device, so these tests run it on CPU. Order statistics,
minimum, maximum, fractions and counts must equal the numpy reference exactly, quartiles too
(numpy's linear method, interpolated in float64); sums are float64 accumulations, checked to
1e-12. The band machinery of ``torch_select`` is driven with hand-built samples, so every
branch (unbounded ends, ties at one value, bands that miss) is reached on purpose, and the
profiler shows when the exact ``kthvalue`` fallback ran.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _core_helpers import assert_row, exact_row, op_calls

from ti_core.reduction import DefaultProfile, ReductionPlan, bands, layout
from ti_core.reduction import torch_rows as rows
from ti_core.reduction import torch_select as sel
from ti_schema import DEFAULT_METRICS

# -- float64 sums -------------------------------------------------------------------------------


def test_sum64_accumulates_a_small_float32_tensor_in_float64() -> None:
    # 1e8 + 65,535 ones: float32 spacing at 1e8 is 8, so a float32 sum cannot hold it
    v = torch.ones(sel.chunk_size(torch.device("cpu")), dtype=torch.float32)
    v[0] = 1e8
    total = sel.sum64(v)
    assert total.dtype == torch.float64
    assert float(total) == 1e8 + v.numel() - 1


def test_sum64_of_several_chunks_and_of_float64() -> None:
    gen = np.random.default_rng(3)
    a = gen.normal(size=3 * sel.chunk_size(torch.device("cpu")) + 5).astype(np.float32)
    got = sel.sum64(torch.from_numpy(a))
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(math.fsum(a.astype(np.float64)), rel=1e-12)
    b = gen.normal(size=1000)
    assert float(sel.sum64(torch.from_numpy(b))) == pytest.approx(math.fsum(b), rel=1e-13)


def test_centered_sum_of_squares_is_float64() -> None:
    a = np.tile(np.array([0.0, 1.0, 1.0], dtype=np.float32), 50_000)
    mean = torch.tensor(math.fsum(a) / a.size, dtype=torch.float64)  # 2/3: not a float32
    got = sel.centered_sum_squares64(torch.from_numpy(a), mean)
    exact = math.fsum((a.astype(np.float64) - float(mean)) ** 2)
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(exact, rel=1e-12)


def test_accelerator_chunks_are_not_empty() -> None:
    assert sel.chunk_size(torch.device("cpu")) >= 1024
    assert sel.chunk_size(torch.device("cuda")) >= sel.chunk_size(torch.device("cpu"))


# -- order statistics -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1_000, sel._SORT_LIMIT, sel._SORT_LIMIT + 1, 300_001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_order_statistics_equal_sorting(n: int, dtype: torch.dtype) -> None:
    gen = np.random.default_rng(n)
    a = np.concatenate([gen.normal(size=n - n // 5), np.repeat(gen.normal(size=10), n // 50 + 1)])
    a = torch.from_numpy(a[:n]).to(dtype)
    assert a.numel() == n
    ranks = [n - 1, 0, 1, n // 4, n // 4 + 1, n // 2, n - 2, n // 4]  # any order, repeats
    got = sel.order_statistics(a, ranks)
    assert got.dtype == torch.float64
    want = np.sort(a.numpy().astype(np.float64))[ranks]
    np.testing.assert_array_equal(got.numpy(), want)


def test_large_order_statistics_come_from_bands_without_kthvalue() -> None:
    gen = np.random.default_rng(5)
    v = torch.from_numpy(gen.normal(size=400_000))
    ranks = [0, 99_999, 100_000, 199_999, 200_000, 399_999]
    got: list[torch.Tensor] = []
    assert op_calls(lambda: got.append(sel.order_statistics(v, ranks)), "aten::kthvalue") == 0
    np.testing.assert_array_equal(got[0].numpy(), np.sort(v.numpy())[ranks])


def test_order_statistics_fall_back_to_kthvalue_when_the_sample_misleads() -> None:
    # Every entry the private sample draws is set to 0: the sample says "all zeros", the band
    # check disproves it and each cluster is answered by kthvalue, exactly.
    n = 300_000
    v = torch.arange(n, dtype=torch.float64) + 1.0
    gen = torch.Generator().manual_seed(bands.SAMPLE_SEED)
    v[torch.randint(n, (bands.SAMPLE_SIZE,), generator=gen)] = 0.0
    ranks = [10, 150_000, 150_001, n - 1]
    got: list[torch.Tensor] = []
    calls = op_calls(lambda: got.append(sel.order_statistics(v, ranks)), "aten::kthvalue")
    assert calls == len(ranks)
    np.testing.assert_array_equal(got[0].numpy(), np.sort(v.numpy())[ranks])


def test_pivot_sample_is_reproducible_and_sorted() -> None:
    v = torch.from_numpy(np.random.default_rng(8).normal(size=200_000))
    first, second = sel._pivot_sample(v), sel._pivot_sample(v)
    assert first.numel() == bands.SAMPLE_SIZE
    assert torch.equal(first, second)  # a private seeded generator, not the global RNG
    assert bool((first[1:] >= first[:-1]).all())


def test_clusters_group_adjacent_ranks_only() -> None:
    assert sel._clusters([0, 1, 3, 5, 6, 9]) == [[0, 1], [3], [5, 6], [9]]
    assert sel._clusters([2, 4]) == [[2], [4]]
    assert sel._clusters([]) == []


# -- the band of one cluster, with built samples --------------------------------------------------


def two_value_sample(m: int, i_lo: int, lo: float, hi: float) -> torch.Tensor:
    """A sorted sample whose entries up to ``i_lo`` are ``lo`` and the rest ``hi``."""
    s = torch.full((m,), hi, dtype=torch.float64)
    s[: i_lo + 1] = lo
    return s


def spans(n: int, cluster: list[int], m: int) -> tuple[int, int]:
    return bands.sample_span(cluster[0] / (n - 1), cluster[-1] / (n - 1), m)


def test_band_at_a_tie_counts_without_copying() -> None:
    # 100 entries below 0, 1,000 zeros, 900 above; the sample says "zero" around the ranks
    v = torch.cat([-torch.arange(1.0, 101.0), torch.zeros(1000), torch.arange(1.0, 901.0)])
    v = v[torch.randperm(v.numel(), generator=torch.Generator().manual_seed(1))].double()
    m = 4096
    zeros = torch.zeros(m, dtype=torch.float64)
    for cluster in ([100, 101], [1098, 1099], [500]):
        i_lo, i_hi = spans(v.numel(), cluster, m)
        assert 0 <= i_lo < i_hi < m  # both ends bounded, both at 0: a tie
        got: list[object] = []

        def select(c: list[int] = cluster, into: list[object] = got) -> None:
            into.append(sel._select_in_band(v, zeros, m, c))

        assert op_calls(select, "aten::masked_select") == 0
        found = got[0]
        assert isinstance(found, dict)
        assert sorted(found) == cluster
        assert all(float(x) == 0.0 for x in found.values())
    # ranks just outside the tie are not answered by it
    assert sel._select_in_band(v, zeros, m, [99, 100]) is None
    assert sel._select_in_band(v, zeros, m, [1099, 1100]) is None


def test_band_without_a_lower_bound_counts_from_zero() -> None:
    n, m = 50_000, 1_000
    v = torch.arange(n, dtype=torch.float64).flip(0)  # order of entries is irrelevant
    cluster = [0, 1]
    i_lo, i_hi = spans(n, cluster, m)
    assert i_lo < 0 <= i_hi < m
    sample = torch.linspace(0, n - 1, m, dtype=torch.float64).floor()
    found = sel._select_in_band(v, sample, m, cluster)
    assert found is not None
    assert [float(found[r]) for r in cluster] == [0.0, 1.0]


def test_band_without_either_bound_is_the_whole_tensor() -> None:
    v = torch.tensor([5.0, -1.0, 3.0, 3.0, 9.0, 0.0], dtype=torch.float64)
    sample = torch.tensor([3.0, 3.0], dtype=torch.float64)  # two entries: both ends open
    i_lo, i_hi = spans(6, [2, 3], 2)
    assert i_lo < 0
    assert i_hi >= 2
    found = sel._select_in_band(v, sample, 2, [2, 3])
    assert found is not None
    assert [float(found[2]), float(found[3])] == [3.0, 3.0]


def test_band_open_above_at_the_sample_size() -> None:
    # a cluster whose upper index lands exactly on m: the band is open above, not sample[m]
    n, m = 10_000, 100
    cluster = next(
        [r] for r in range(n - 1, 0, -1) if spans(n, [r], m)[1] == m and spans(n, [r], m)[0] >= 0
    )
    i_lo, _ = spans(n, cluster, m)
    v = torch.arange(n, dtype=torch.float64)
    sample = torch.linspace(0, n - 1, m, dtype=torch.float64).floor()
    found = sel._select_in_band(v, sample, m, cluster)
    assert found is not None
    assert float(found[cluster[0]]) == float(cluster[0])
    assert float(sample[i_lo]) <= cluster[0]


@pytest.mark.parametrize("offset", [0, 10, 11])
def test_band_edges_are_exact(offset: int) -> None:
    # a band [c, c + 10] of arange(n) holds ranks c..c+10 and nothing else: the rank on its
    # lower end is inside, the one past its upper end is not
    n, m, c = 20_000, 512, 9_000
    rank = c + offset
    v = torch.arange(n, dtype=torch.float64)
    i_lo, i_hi = spans(n, [rank], m)
    assert 0 <= i_lo < i_hi < m
    found = sel._select_in_band(v, two_value_sample(m, i_lo, float(c), float(c + 10)), m, [rank])
    if offset <= 10:
        assert found is not None
        assert float(found[rank]) == float(rank)
    else:
        assert found is None


def test_band_that_misses_above_is_refused() -> None:
    n, m = 20_000, 512
    v = torch.arange(n, dtype=torch.float64)
    rank = 15_000
    i_lo, _ = spans(n, [rank], m)
    assert sel._select_in_band(v, two_value_sample(m, i_lo, 100.0, 120.0), m, [rank]) is None


# -- profile rows -------------------------------------------------------------------------------


def mixed(n: int, seed: int, nonfinite: bool) -> np.ndarray:
    gen = np.random.default_rng(seed)
    a = gen.normal(3.0, 2.0, size=n).astype(np.float32)
    a[gen.random(n) < 0.2] = 0.0
    if nonfinite:
        a[gen.integers(0, n, 50)] = np.nan
        a[gen.integers(0, n, 5)] = np.inf
        a[gen.integers(0, n, 5)] = -np.inf
    return a


# 150,002 entries: every quartile position has a fraction (0.25, 0.5, 0.75)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_large_row_exact(nonfinite: bool) -> None:
    a = mixed(150_002, 1, nonfinite)
    row = rows.large_row_exact(torch.from_numpy(a))
    assert row.dtype == torch.float64
    assert_row(row, a)


def test_large_row_exact_with_inf_only_above() -> None:
    a = mixed(150_002, 2, False)
    a[7] = np.inf  # the minimum is finite, the maximum is not
    assert_row(rows.large_row_exact(torch.from_numpy(a)), a)


def test_large_row_exact_counts_beyond_float32() -> None:
    # 2**24 + 3 finite entries: float32 cannot hold that count
    a = np.zeros(2**24 + 5, dtype=np.float32)
    a[:2] = np.nan
    a[2::7] = 1.5
    columns = layout.DEFAULT_LAYOUT.columns
    row = dict(zip(columns, rows.large_row_exact(torch.from_numpy(a)).tolist(), strict=True))
    assert row["finite_count"] == 2**24 + 3
    assert row["nonfinite_fraction"] == 2 / a.size


def test_large_row_exact_without_finite_entries() -> None:
    a = np.full(70_000, np.nan, dtype=np.float32)
    a[::3] = np.inf
    row = rows.large_row_exact(torch.from_numpy(a))
    assert row.dtype == torch.float64
    assert_row(row, a)


@pytest.mark.parametrize("n", [150_002, 150_001])
def test_large_row_optimistic_on_finite_data(n: int) -> None:
    a = mixed(n, 3, False)
    row = rows.large_row_optimistic(torch.from_numpy(a))
    assert row.dtype == torch.float64
    assert_row(row, a)


def test_batched_rows_pad_rows_of_several_widths() -> None:
    # shapes of one size class (17..32 entries) in one matrix: 20 and 32 entries, padded
    gen = np.random.default_rng(4)
    narrow = [torch.from_numpy(gen.normal(size=(4, 5)).astype(np.float32)) for _ in range(3)]
    wide = [torch.from_numpy(gen.normal(size=(32,)).astype(np.float32)) for _ in range(2)]
    narrow[1][0, :3] = 0.0
    narrow[2].fill_(np.nan)
    narrow[2][1, 1] = 2.5  # a single finite entry
    wide[0][5:] = np.nan
    out = rows.batched_rows([narrow, wide], torch.device("cpu"))
    assert out.shape == (5, layout.DEFAULT_LAYOUT.width)
    assert out.dtype == torch.float64
    for got, t in zip(out, [*narrow, *wide], strict=True):
        assert_row(got, t.numpy())


# -- the plan on the torch engine ---------------------------------------------------------------


@pytest.mark.usefixtures("torch_engine")
def test_plan_on_the_torch_engine_is_exact() -> None:
    gen = np.random.default_rng(6)
    small = [torch.from_numpy(mixed(20, s, s % 2 == 0).reshape(4, 5)) for s in range(6)]
    small += [torch.from_numpy(mixed(30, 9, True)), torch.zeros(25), torch.arange(24.0)]
    large = [
        torch.from_numpy(mixed(150_002, 11, False)),
        torch.from_numpy(mixed(150_002, 12, True)),  # optimistic, then redone exactly
        torch.from_numpy(gen.integers(-5, 5, size=(300, 301)).astype(np.int32)),
    ]
    tensors = [*small, *large]
    plan = ReductionPlan([DefaultProfile()])
    m = plan.reduce(tensors)
    assert not m.errors
    for i, t in enumerate(tensors):
        want = exact_row(t.numpy())
        for j, name in enumerate(DEFAULT_METRICS):
            if name not in want:
                assert not m.available[i, j]
                assert m.reasons[i][j] == "no finite entries"
            elif name in ("mean", "std"):
                assert m.values[i, j] == pytest.approx(want[name], rel=1e-12, abs=1e-300)
            else:
                assert m.values[i, j] == want[name], (i, name)


@pytest.mark.usefixtures("torch_engine")
def test_plan_retries_exactly_only_the_tensors_holding_nonfinite_entries() -> None:
    clean = torch.from_numpy(mixed(150_002, 13, False))
    dirty = torch.from_numpy(mixed(150_002, 14, True))
    plan = ReductionPlan([DefaultProfile(("p50", "min"))])
    # the exact retry counts non-finite entries with aminmax; the optimistic pass does not
    assert op_calls(lambda: plan.reduce([clean]), "aten::aminmax") == 0
    assert op_calls(lambda: plan.reduce([clean, dirty]), "aten::aminmax") >= 1
    m = plan.reduce([dirty, clean])
    for i, t in enumerate((dirty, clean)):
        want = exact_row(t.numpy())
        assert m.values[i].tolist() == [want["p50"], want["min"]]
