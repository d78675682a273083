"""The default metric profile and custom reducers, against numpy float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _core_helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from ti_core.reduction import (
    DefaultProfile,
    Measurements,
    Reducer,
    ReductionPlan,
    bands,
    default_reducers,
    numpy_rows,
    quantiles,
    support,
    torch_select,
)
from ti_schema import DEFAULT_METRICS

FINITE = ("mean", "std", "min", "max", "p25", "p50", "p75")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
ALL_DTYPES = (*FLOAT_DTYPES, *INT_DTYPES, torch.bool)


def reference(t: torch.Tensor) -> dict[str, float | None]:
    """Independent numpy float64 reference of the default profile (None: unavailable)."""
    a = t.detach().cpu().to(torch.float64).numpy().ravel()
    if a.size == 0:
        return dict.fromkeys(DEFAULT_METRICS)
    finite = a[np.isfinite(a)]
    out: dict[str, float | None] = {
        "zero_fraction": np.count_nonzero(a == 0) / a.size,
        "nonfinite_fraction": (a.size - finite.size) / a.size,
    }
    if finite.size == 0:
        out.update(dict.fromkeys(FINITE))
        return out
    p25, p50, p75 = np.percentile(finite, [25, 50, 75])
    out.update(
        mean=float(np.mean(finite)),
        std=float(np.std(finite)),
        min=float(np.min(finite)),
        max=float(np.max(finite)),
        p25=float(p25),
        p50=float(p50),
        p75=float(p75),
    )
    return out


def assert_matches(m: Measurements, names: tuple[str, ...], i: int, t: torch.Tensor) -> None:
    ref = reference(t)
    a = t.detach().cpu().to(torch.float64).numpy().ravel()
    finite = a[np.isfinite(a)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
    for j, name in enumerate(names):
        if name not in ref:
            continue
        expected = ref[name]
        if expected is None:
            assert not m.available[i, j], (name, m.values[i, j])
            assert m.reasons[i][j], name
        else:
            assert m.available[i, j], (name, m.reasons[i][j])
            assert m.reasons[i][j] is None
            # 1e-5 relative; values that cancel to about zero are compared at float64
            # precision of the tensor's scale.
            assert m.values[i, j] == pytest.approx(expected, rel=1e-5, abs=1e-12 * scale), (
                name,
                t.dtype,
                tuple(t.shape),
            )


def reduce_default(tensors: list[torch.Tensor]) -> Measurements:
    return ReductionPlan(default_reducers()).reduce(tensors)


def random_tensor(
    gen: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...], nonfinite: float
) -> torch.Tensor:
    size = math.prod(shape)
    if dtype == torch.bool:
        return torch.from_numpy(gen.random(size) < 0.3).reshape(shape)
    if dtype in INT_DTYPES:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -1000), min(info.max, 1000)
        ints = gen.integers(lo, hi + 1, size=size)
        ints[gen.random(size) < 0.2] = 0
        return torch.from_numpy(ints).to(dtype).reshape(shape)
    vals = gen.normal(gen.normal() * 3, abs(gen.normal()) + 0.1, size=size)
    vals[gen.random(size) < 0.1] = 0.0
    specials = gen.random(size) < nonfinite
    vals[specials] = gen.choice([np.nan, np.inf, -np.inf], size=int(specials.sum()))
    return torch.from_numpy(vals).to(dtype).reshape(shape)


# -- semantics ------------------------------------------------------------------------------


def test_default_profile_names_follow_the_schema() -> None:
    assert default_reducers() == (DefaultProfile(),)
    assert ReductionPlan(default_reducers()).metric_names == DEFAULT_METRICS


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_each_dtype_matches_numpy(dtype: torch.dtype) -> None:
    gen = np.random.default_rng(7)
    shapes = [(1,), (3,), (2, 8), (4, 5, 3), (97,), (64, 64), (3, 1000)]
    tensors = [random_tensor(gen, dtype, s, 0.05) for s in shapes]
    m = reduce_default(tensors)
    for i, t in enumerate(tensors):
        assert_matches(m, DEFAULT_METRICS, i, t)


def test_many_small_tensors_of_mixed_sizes_and_dtypes_keep_their_own_rows() -> None:
    gen = np.random.default_rng(3)
    tensors = []
    for k in range(300):
        dtype = ALL_DTYPES[k % len(ALL_DTYPES)]
        shape = (int(gen.integers(1, 5)), int(gen.integers(1, 40)))
        tensors.append(random_tensor(gen, dtype, shape, 0.1))
    m = reduce_default(tensors)
    assert m.values.shape == (300, len(DEFAULT_METRICS))
    assert not m.errors
    for i, t in enumerate(tensors):
        assert_matches(m, DEFAULT_METRICS, i, t)


def test_empty_all_nan_and_inf_tensors_explain_their_nulls() -> None:
    empty = torch.zeros(0, 3)
    all_nan = torch.full((4,), math.nan)
    infs = torch.tensor([math.inf, -math.inf, 0.0, 2.0])
    m = reduce_default([empty, all_nan, infs])
    assert not m.available[0].any()
    assert m.reasons[0] == ["empty tensor (numel=0)"] * len(DEFAULT_METRICS)
    col = {n: j for j, n in enumerate(DEFAULT_METRICS)}
    for name in FINITE:
        assert not m.available[1, col[name]]
        assert m.reasons[1][col[name]] == "no finite entries"
    assert m.values[1, col["nonfinite_fraction"]] == 1.0
    assert m.values[1, col["zero_fraction"]] == 0.0
    assert m.values[2, col["nonfinite_fraction"]] == 0.5
    assert m.values[2, col["zero_fraction"]] == 0.25
    assert m.values[2, col["mean"]] == 1.0
    assert m.values[2, col["min"]] == 0.0
    assert m.values[2, col["max"]] == 2.0
    # available exactly where there is no reason
    for i in range(3):
        for j in range(len(DEFAULT_METRICS)):
            assert m.available[i, j] == (m.reasons[i][j] is None)


def test_quantile_positions_are_numpys_virtual_indexes() -> None:
    """(lower rank, upper rank, fraction) of each quartile of n sorted values: the virtual index
    q * (n - 1) split into its floor and fraction; the upper rank is the next one only when the
    fraction is not zero, and never past the last value."""
    for n in range(1, 64):
        got = quantiles.quantile_positions(n)
        assert len(got) == len(quantiles.QUANTILES)
        for (lo, hi, frac), q in zip(got, quantiles.QUANTILES, strict=True):
            pos = q * (n - 1)
            assert (lo, frac) == (math.floor(pos), pos - math.floor(pos)), (n, q)
            assert hi == (lo if frac == 0.0 else lo + 1), (n, q)
            assert 0 <= lo <= hi < n, (n, q)


def test_lerp_gives_numpys_bits() -> None:
    """lerp, lerp_array and lerp_tensor give numpy's linear quantile to the bit (numpy's _lerp
    switches formula at t = 0.5). On two sorted values the quantile q is the interpolation at
    t = q between them, so numpy.quantile of each pair is the reference."""
    rng = np.random.default_rng(5)
    scale = rng.choice([1e-3, 1.0, 1e3], size=(4000, 1))
    pairs = np.sort(rng.standard_normal((4000, 2)) * scale, axis=1)
    a, b = pairs[:, 0], pairs[:, 1]
    for q in quantiles.QUANTILES:
        want = np.quantile(pairs, q, axis=1)
        got = {
            "lerp": np.array([quantiles.lerp(x, y, q) for x, y in pairs]),
            "lerp_array": quantiles.lerp_array(a, b, np.full(len(a), q)),
            "lerp_tensor": quantiles.lerp_tensor(
                torch.from_numpy(a), torch.from_numpy(b), q
            ).numpy(),
        }
        for name, values in got.items():
            assert np.array_equal(values.view(np.int64), want.view(np.int64)), (name, q)
        # the two formulas differ in the last bit for some pairs: the check above decides
        assert np.any((b - (b - a) * (1.0 - q)) != (a + (b - a) * q)), q


def test_zeros_are_written_as_positive_zero() -> None:
    """-0.0 and +0.0 are equal, and which one an order statistic of a tensor holding both
    picks depends on the sort or selection code numpy dispatches to for the CPU: every zero is
    written as +0.0, so rows do not depend on the machine. Small and large (over 65,536
    entries) tensors, all negative zeros and a mix."""
    col = {n: j for j, n in enumerate(DEFAULT_METRICS)}
    mixed = torch.zeros(9)
    mixed[::2] = -0.0
    tensors = [
        torch.full((7,), -0.0),
        mixed,
        torch.full((70_001,), -0.0),
        torch.tensor([-0.0, 0.0] * 40_000),
        torch.full((5,), -0.0, dtype=torch.float64),
    ]
    m = reduce_default(tensors)
    for i, t in enumerate(tensors):
        assert torch.signbit(t).any(), i  # the inputs do hold negative zeros
        for name in FINITE:
            value = m.values[i, col[name]]
            assert m.available[i, col[name]], (i, name)
            assert value == 0.0, (i, name, value)
            assert not math.copysign(1.0, value) < 0, (i, name, value.hex())
        assert m.values[i, col["zero_fraction"]] == 1.0


def test_zero_dim_noncontiguous_and_grad_tensors() -> None:
    base = torch.randn(6, 10, dtype=torch.float64)
    views = [
        torch.tensor(2.5),
        base.t(),
        base[::2, 1::3],
        base.expand(3, 6, 10),
        torch.randn(5, 4, requires_grad=True) * 2,
        torch.randn(300, 400).t()[::2],  # large, non-contiguous
    ]
    m = reduce_default(views)
    for i, t in enumerate(views):
        assert_matches(m, DEFAULT_METRICS, i, t)


def test_bool_mean_is_the_true_fraction_and_ints_are_numbers() -> None:
    mask = torch.tensor([True, False, True, True])
    big = torch.tensor([2**40, -(2**40), 3, 0], dtype=torch.int64)
    m = reduce_default([mask, big])
    assert m.values[0, 0] == 0.75
    assert_matches(m, DEFAULT_METRICS, 1, big)


def test_half_precision_large_values_do_not_overflow() -> None:
    f16 = torch.full((1000,), 60000.0, dtype=torch.float16)
    f16[::2] = -60000.0
    bf16 = torch.tensor([3e38, -3e38, 1e38, 0.0], dtype=torch.bfloat16)
    big_f16 = torch.full((100_000,), 65504.0, dtype=torch.float16)
    big_f16[::3] = -65504.0
    m = reduce_default([f16, bf16, big_f16])
    assert m.values[0, 1] == pytest.approx(60000.0)
    for i, t in enumerate([f16, bf16, big_f16]):
        assert_matches(m, DEFAULT_METRICS, i, t)


@pytest.mark.parametrize("size", [50, 300_000])
def test_large_mean_to_std_ratio_keeps_std_exact(size: int) -> None:
    gen = np.random.default_rng(11)
    vals = 10_000.0 + gen.normal(0, 0.05, size)
    t = torch.from_numpy(vals).to(torch.float32)
    shifted = torch.from_numpy(1e6 + gen.normal(0, 1.0, size))  # float64, ratio 1e6
    m = reduce_default([t, shifted])
    assert_matches(m, DEFAULT_METRICS, 0, t)
    assert_matches(m, DEFAULT_METRICS, 1, shifted)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_large_tensors_of_every_dtype(dtype: torch.dtype) -> None:
    gen = np.random.default_rng(5)
    t = random_tensor(gen, dtype, (300, 701), 0.02)
    m = reduce_default([t])
    assert_matches(m, DEFAULT_METRICS, 0, t)


def test_large_tensors_with_ties_nans_and_no_finite_entries() -> None:
    gen = np.random.default_rng(2)
    ties = torch.from_numpy(gen.integers(0, 4, 500_000).astype(np.float32))
    constant = torch.full((200_001,), 3.25)
    nan_heavy = torch.from_numpy(gen.normal(size=400_000).astype(np.float32))
    nan_heavy[:300_000:2] = math.nan
    nan_heavy[1:1000:7] = -math.inf
    all_inf = torch.full((100_000,), math.inf)
    sorted_desc = torch.arange(300_000, 0, -1, dtype=torch.float64)
    tensors = [ties, constant, nan_heavy, all_inf, sorted_desc]
    m = reduce_default(tensors)
    for i, t in enumerate(tensors):
        assert_matches(m, DEFAULT_METRICS, i, t)


def test_large_ties_at_band_ends_and_few_finite_entries() -> None:
    gen = torch.Generator().manual_seed(4)
    relu = torch.relu(torch.randn(400_000, generator=gen))  # half the entries tie at 0
    steps = torch.randint(0, 3, (300_000,), generator=gen).to(torch.float32)
    sparse = torch.full((300_000,), math.nan)
    sparse[::50_000] = torch.arange(6, dtype=torch.float32)  # the sample sees no finite value
    tensors = [relu, steps, sparse, relu.to(torch.float64).neg()]
    m = reduce_default(tensors)
    assert not m.errors
    for i, t in enumerate(tensors):
        assert_matches(m, DEFAULT_METRICS, i, t)


def test_cpu_scan_falls_back_to_exact_partition_when_bands_miss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def far_bands(a: np.ndarray) -> list[numpy_rows._Band]:
        return [numpy_rows._Band(1e6, 2e6, tied=False) for _ in range(3)]

    monkeypatch.setattr(numpy_rows, "_bands", far_bands)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(9))
    x[::7] = math.inf
    m = reduce_default([x])
    assert_matches(m, DEFAULT_METRICS, 0, x)


def test_tensor_above_2_pow_24_has_exact_quartiles() -> None:
    n = 2**24 + 1
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * 3.0 + 1.5
    x[::1000] = 0.0
    m = reduce_default([x])
    a = x.numpy().astype(np.float64)
    expected = {
        "mean": np.mean(a),
        "std": np.std(a),
        "min": a.min(),
        "max": a.max(),
        "zero_fraction": np.count_nonzero(a == 0) / n,
        "nonfinite_fraction": 0.0,
    }
    # quartiles of 2**24 + 1 values sit exactly on ranks 2**22, 2**23, 3 * 2**22
    part = np.partition(a, [2**22, 2**23, 3 * 2**22])
    expected.update(p25=part[2**22], p50=part[2**23], p75=part[3 * 2**22])
    for j, name in enumerate(DEFAULT_METRICS):
        assert m.available[0, j], m.reasons[0][j]
        assert m.values[0, j] == pytest.approx(expected[name], rel=1e-5, abs=1e-12), name
    for name in ("min", "max", "p25", "p50", "p75"):
        assert m.values[0, DEFAULT_METRICS.index(name)] == expected[name]  # exact order stats


def test_reduction_leaves_the_global_rng_untouched() -> None:
    before = torch.get_rng_state()
    reduce_default([torch.arange(400_000, dtype=torch.float32), torch.ones(3)])
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("n", [200_000, 1_000_003])
def test_selection_matches_sorting(n: int) -> None:
    gen = np.random.default_rng(n)
    pieces = [gen.normal(size=n // 2), np.repeat(gen.normal(size=50), n // 100 + 1)]
    a = np.concatenate(pieces)[:n]
    v = torch.from_numpy(a)
    ranks = [0, 1, n // 4, n // 4 + 1, n // 2, n - 2, n - 1]
    got = torch_select.order_statistics(v, ranks).numpy()
    np.testing.assert_array_equal(got, np.sort(a)[ranks])


def test_selection_falls_back_when_the_band_misses() -> None:
    v = torch.arange(300_000, dtype=torch.float32)
    sample = torch.zeros(bands.SAMPLE_SIZE)  # pivots that bracket nothing useful
    assert torch_select._select_in_band(v, sample, sample.numel(), [150_000]) is None
    good = torch_select._pivot_sample(v)
    found = torch_select._select_in_band(v, good, good.numel(), [150_000, 150_001])
    assert found is not None
    assert float(found[150_000]) == 150_000.0
    assert float(found[150_001]) == 150_001.0


# -- accelerator paths, run on CPU ---------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.float32, torch.float64, torch.int32, torch.bool], ids=str
)
def test_accelerator_code_paths_match_numpy(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The torch-only paths used on accelerators (device-side batching, optimistic kthvalue
    # with the exact retry for tensors holding NaN/inf) are device-agnostic: run them here.
    monkeypatch.setattr(support, "uses_numpy", lambda device: False)
    gen = np.random.default_rng(12)
    tensors = [
        random_tensor(gen, dtype, (3, 7), 0.1),
        random_tensor(gen, dtype, (2, 8), 0.0),
        random_tensor(gen, dtype, (150_001,), 0.0),
        random_tensor(gen, dtype, (400, 500), 0.05),
        torch.full((70_000,), math.nan).to(dtype) if dtype.is_floating_point else torch.zeros(5),
    ]
    m = reduce_default(tensors)
    assert not m.errors
    for i, t in enumerate(tensors):
        assert_matches(m, DEFAULT_METRICS, i, t)


# -- other dtypes -----------------------------------------------------------------------------


def unsupported_tensors() -> list[torch.Tensor]:
    out = [
        torch.ones(3, dtype=torch.complex64),
        torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8),
        torch.ones(2, 2).to_sparse(),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        out.append(torch.ones(5).to(torch.float8_e4m3fn))
    return out


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation:UserWarning")
def test_other_dtypes_are_explained_nulls_and_custom_reducers_still_run() -> None:
    tensors = unsupported_tensors()
    plan = ReductionPlan([DefaultProfile(), Reducer("numel", lambda t: float(t.numel()))])
    m = plan.reduce(tensors)
    assert not m.errors
    for i, t in enumerate(tensors):
        assert not m.available[i, :-1].any()
        reason = m.reasons[i][0]
        assert reason is not None
        if t.layout == torch.strided:
            assert str(t.dtype).removeprefix("torch.") in reason
        else:
            assert "layout" in reason
        assert m.values[i, -1] == t.numel()


# -- custom reducers ---------------------------------------------------------------------------


def test_custom_reducers_join_the_table() -> None:
    plan = ReductionPlan(
        [
            Reducer("l2", lambda t: torch.linalg.vector_norm(t.double())),
            DefaultProfile(names=("max", "mean")),
            Reducer("count", lambda t: t.numel()),
        ]
    )
    assert plan.metric_names == ("l2", "max", "mean", "count")
    x = torch.tensor([[3.0, 4.0]])
    m = plan.reduce([x, torch.zeros(0)])
    np.testing.assert_allclose(m.values[0], [5.0, 4.0, 3.5, 2.0])
    assert m.available[0].all()
    assert not m.available[1].any()
    assert m.reasons[1] == ["empty tensor (numel=0)"] * 4


def test_failing_custom_reducer_is_a_null_with_its_exception() -> None:
    def boom(t: torch.Tensor) -> float:
        raise RuntimeError("bad reducer")

    plan = ReductionPlan(
        [
            *default_reducers(),
            Reducer("boom", boom),
            Reducer("vector", lambda t: t.reshape(-1)),
            Reducer("nan", lambda t: torch.tensor(math.nan)),
        ]
    )
    x = torch.randn(2, 8)
    m = plan.reduce([x, x])
    assert_matches(m, plan.metric_names, 0, x)
    j = plan.metric_names.index("boom")
    assert not m.available[:, j].any()
    assert m.reasons[0][j] == "RuntimeError: bad reducer"
    v = plan.metric_names.index("vector")
    assert not m.available[0, v]
    assert str(m.reasons[0][v]).startswith("TypeError: Reducer 'vector' returned")
    nan_col = plan.metric_names.index("nan")
    assert not m.available[0, nan_col]
    assert m.reasons[0][nan_col] == "Reducer 'nan' returned nan"
    assert len(m.errors) == 4  # boom and vector, once per tensor; a NaN result is no error
    assert all(isinstance(e, (RuntimeError, TypeError)) for e in m.errors)


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reducers", "error", "words"),
    [
        ([], ValueError, "reducers is empty"),
        (DefaultProfile(), TypeError, "sequence"),
        ("mean", TypeError, "sequence"),
        ([DefaultProfile(), Reducer("mean", torch.mean)], ValueError, "'mean'"),
        ([Reducer("a", torch.mean), Reducer("a", torch.std)], ValueError, "unique"),
        ([DefaultProfile(), DefaultProfile()], ValueError, "once"),
        ([torch.mean], TypeError, "reducers[0]"),
        ([DefaultProfile(names=("median",))], ValueError, "median"),
    ],
)
def test_bad_reducers_are_rejected_naming_the_argument(
    reducers: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match="reducers") as info:
        ReductionPlan(reducers)  # type: ignore[arg-type]
    assert words in str(info.value)


def test_reducer_checks_its_fields() -> None:
    with pytest.raises(TypeError, match="non-empty string"):
        Reducer("", torch.mean)
    with pytest.raises(TypeError, match="callable"):
        Reducer("x", 3)  # type: ignore[arg-type]


# -- property test -----------------------------------------------------------------------------


@settings(max_examples=examples(60), deadline=None)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    shapes=st.lists(
        st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5
    ),
    nonfinite=st.sampled_from([0.0, 0.2, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_default_profile_matches_numpy(
    dtype: torch.dtype, shapes: list[tuple[int, ...]], nonfinite: float, seed: int
) -> None:
    gen = np.random.default_rng(seed)
    tensors = [random_tensor(gen, dtype, s, nonfinite) for s in shapes]
    m = reduce_default(tensors)
    assert not m.errors
    for i, t in enumerate(tensors):
        assert_matches(m, DEFAULT_METRICS, i, t)
