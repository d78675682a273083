"""The reduction plan's own paths: whole error messages, batching bounds, non-tensors, custom
reducers on both engines, and failures inside the default profile (a tensor subclass whose
operations raise), which become explained nulls and ``errors`` without touching the other
tensors' numbers."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from _core_helpers import exact_row, op_calls
from torch import nn

from ti_core.reduction import DefaultProfile, Reducer, ReductionPlan, support
from ti_core.reduction import plan as plan_module
from ti_schema import DEFAULT_METRICS


class Faulty(torch.Tensor):
    """A tensor whose listed operations raise, as a third-party subclass might."""

    fail: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__name__", "") in cls.fail:
            raise RuntimeError(f"faulty {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture
def faulty() -> Any:
    yield Faulty
    Faulty.fail = frozenset()


def assert_exact(m: plan_module.Measurements, i: int, t: torch.Tensor) -> None:
    want = exact_row(t.detach().to(torch.float64).numpy())
    for j, name in enumerate(DEFAULT_METRICS):
        if name not in want:
            assert not m.available[i, j], name
        elif name in ("mean", "std"):
            assert m.values[i, j] == pytest.approx(want[name], rel=1e-12, abs=1e-300), name
        else:
            assert m.values[i, j] == want[name], (i, name)
        if m.available[i, j]:
            assert m.reasons[i][j] is None


# -- messages -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reducers", "error", "message"),
    [
        (
            DefaultProfile(),
            TypeError,
            "reducers must be a sequence of DefaultProfile/Reducer, got DefaultProfile; pass "
            "e.g. reducers=[*default_reducers(), Reducer('name', fn)]",
        ),
        (
            [],
            ValueError,
            "reducers is empty, so nothing would be measured; pass default_reducers() or at "
            "least one Reducer",
        ),
        (
            [DefaultProfile(), DefaultProfile()],
            ValueError,
            "reducers[1] repeats DefaultProfile; list the default profile once",
        ),
        (
            [DefaultProfile(names=())],
            ValueError,
            f"reducers[0]: DefaultProfile(names=()) must be a non-empty tuple drawn from "
            f"{DEFAULT_METRICS}; unknown: []",
        ),
        (
            [Reducer("x", torch.mean), 3],
            TypeError,
            "reducers[1] is a int; each item must be DefaultProfile() or Reducer(name, fn)",
        ),
        (
            [DefaultProfile(), Reducer("max", torch.amax)],
            ValueError,
            "reducers name the metric(s) ['max'] more than once; give every Reducer a unique "
            "name that is not also a default metric",
        ),
    ],
    ids=["not-a-sequence", "empty", "repeated", "no-names", "foreign", "duplicate"],
)
def test_bad_reducers_get_the_whole_message(
    reducers: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ReductionPlan(reducers)  # type: ignore[arg-type]


def test_reducer_messages() -> None:
    with pytest.raises(TypeError) as info:
        Reducer("", torch.mean)
    assert str(info.value) == (
        "Reducer(name=...) must be a non-empty string, got ''; name the metric, e.g. "
        "Reducer('abs_max', lambda t: t.abs().max())"
    )
    with pytest.raises(TypeError) as info:
        Reducer("x", 3)  # type: ignore[arg-type]
    assert str(info.value) == (
        "Reducer(fn=...) for metric 'x' must be callable, got int; pass a function tensor -> number"
    )


# -- inputs ---------------------------------------------------------------------------------------


def test_measurements_have_documented_dtypes_and_skip_non_tensors() -> None:
    x, y = torch.tensor([1.0, -2.0, 0.0]), torch.tensor([[4.0, 5.0]])
    m = ReductionPlan([DefaultProfile()]).reduce([x, "text", y])  # type: ignore[list-item]
    assert m.values.dtype == np.float64
    assert m.available.dtype == np.bool_
    assert m.values.shape == m.available.shape == (3, len(DEFAULT_METRICS))
    assert m.reasons[1] == ["not a tensor: str"] * len(DEFAULT_METRICS)
    assert not m.available[1].any()
    assert_exact(m, 0, x)
    assert_exact(m, 2, y)  # the tensors after it are measured


def test_small_float64_and_parameters_are_read_exactly() -> None:
    # float64 values that float32 would round, and a parameter that requires grad
    a = torch.tensor([1.0 + 2**-40, 1.0, 1.0 + 2**-30, -3.0 + 2**-35], dtype=torch.float64)
    p = nn.Parameter(torch.tensor([[0.25, -1.5, 3.0], [0.0, 7.0, 2.0]]))
    h = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float16)
    tensors = [a, a * 3, p, h]
    m = ReductionPlan([DefaultProfile()]).reduce(tensors)
    assert not m.errors
    for i, t in enumerate(tensors):
        assert_exact(m, i, t)


def test_batches_stay_under_the_element_bound_and_cover_every_tensor() -> None:
    width = 1 << 16
    by_shape = {
        (torch.Size([256, 256]), torch.float32): list(range(40)),
        (torch.Size([40_000]), torch.float32): list(range(40, 45)),
    }
    batches = plan_module._batches(by_shape)
    per_batch = plan_module._BATCH_ELEMENTS // width
    assert [len([i for part in b for i in part]) for b in batches] == [16, 16, 13]
    assert all(sum(map(len, b)) * width <= plan_module._BATCH_ELEMENTS for b in batches)
    assert [i for b in batches for part in b for i in part] == list(range(45))
    assert per_batch == 16


def test_many_medium_tensors_in_several_batches() -> None:
    gen = np.random.default_rng(2)
    tensors = [torch.from_numpy(gen.normal(size=(256, 256)).astype(np.float32)) for _ in range(20)]
    m = ReductionPlan([DefaultProfile()]).reduce(tensors)
    assert not m.errors
    for i in (0, 15, 16, 19):
        assert_exact(m, i, tensors[i])


# -- custom reducers ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_custom_reducers_after_an_empty_tensor(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if engine == "torch":
        monkeypatch.setattr(support, "uses_numpy", lambda device: False)
    plan = ReductionPlan(
        [
            Reducer("l1", lambda t: t.abs().sum()),
            Reducer("last", lambda t: t.reshape(-1)[-1].to(torch.float32)),
            Reducer("n", lambda t: float(t.numel())),
            Reducer("inf", lambda t: math.inf),
        ]
    )
    tensors = [torch.zeros(0), torch.tensor([1.0, -2.5]), torch.tensor([[3.0], [-0.125]])]
    m = plan.reduce(tensors)
    assert m.reasons[0] == ["empty tensor (numel=0)"] * 4
    assert m.values[1, :3].tolist() == [3.5, -2.5, 2.0]
    assert m.values[2, :3].tolist() == [3.125, -0.125, 2.0]
    assert m.available[1:, :3].all()
    assert m.reasons[1][:3] == [None, None, None]
    assert not m.available[1:, 3].any()
    assert m.reasons[2][3] == "Reducer 'inf' returned inf"


def test_a_custom_reducer_returning_a_vector_is_named_with_its_dtype_and_shape() -> None:
    plan = ReductionPlan([Reducer("vector", lambda t: t.reshape(-1) * 2)])
    m = plan.reduce([torch.ones(2, 3, dtype=torch.float16)])
    assert m.reasons[0] == [
        "TypeError: Reducer 'vector' returned a float16 tensor of shape (6,); return a real "
        "0-d tensor or a number"
    ]


# -- failures inside the default profile -----------------------------------------------------------


def test_a_failing_small_batch_is_explained_and_the_others_are_measured(faulty: Any) -> None:
    faulty.fail = frozenset({"numpy"})
    bad = torch.tensor([1.0, 2.0, 3.0]).as_subclass(faulty)
    good = torch.tensor([[5.0, -1.0, 0.0, 2.0], [0.5, 0.0, -3.0, 1.0]])  # another size class
    m = ReductionPlan([DefaultProfile(), Reducer("n", lambda t: float(t.numel()))]).reduce(
        [good, bad]
    )
    assert [str(e) for e in m.errors] == ["faulty numpy"]
    assert m.reasons[1][: len(DEFAULT_METRICS)] == ["RuntimeError: faulty numpy"] * len(
        DEFAULT_METRICS
    )
    assert not m.available[1, : len(DEFAULT_METRICS)].any()
    assert m.available[1, -1]
    assert m.values[1, -1] == 3.0
    assert_exact(m, 0, good)


def test_a_failing_large_tensor_is_explained_and_the_others_are_measured(faulty: Any) -> None:
    faulty.fail = frozenset({"numpy"})
    bad = torch.ones(70_000).as_subclass(faulty)
    good = torch.arange(70_000.0)
    m = ReductionPlan([DefaultProfile()]).reduce([bad, good, torch.ones(3)])
    assert [str(e) for e in m.errors] == ["faulty numpy"]
    assert m.reasons[0] == ["RuntimeError: faulty numpy"] * len(DEFAULT_METRICS)
    assert_exact(m, 1, good)
    assert_exact(m, 2, torch.ones(3))


@pytest.mark.usefixtures("torch_engine")
def test_a_failing_transfer_is_explained_for_its_device(faulty: Any) -> None:
    faulty.fail = frozenset({"cpu"})
    bad = torch.tensor([1.0, 2.0]).as_subclass(faulty)
    plan = ReductionPlan([DefaultProfile(("mean",)), Reducer("s", lambda t: t.sum())])
    m = plan.reduce([bad, torch.zeros(0)])
    assert [str(e) for e in m.errors] == ["faulty cpu"]
    assert m.reasons[0] == ["RuntimeError: faulty cpu", "RuntimeError: faulty cpu"]
    assert not m.available[0].any()
    assert m.reasons[1] == ["empty tensor (numel=0)"] * 2


@pytest.mark.usefixtures("torch_engine")
def test_a_failing_exact_retry_is_explained_and_the_others_keep_their_rows(faulty: Any) -> None:
    values = torch.arange(70_000.0)
    values[7] = math.nan
    faulty.fail = frozenset({"aminmax"})
    bad = values.clone().as_subclass(faulty)
    good = torch.arange(70_000.0) - 5.0
    m = ReductionPlan([DefaultProfile()]).reduce([good, bad, torch.ones(4)])
    assert [str(e) for e in m.errors] == ["faulty aminmax"]
    assert m.reasons[1] == ["RuntimeError: faulty aminmax"] * len(DEFAULT_METRICS)
    assert not m.available[1].any()
    assert_exact(m, 0, good)
    assert_exact(m, 2, torch.ones(4))


@pytest.mark.usefixtures("torch_engine")
def test_small_tensors_with_nonfinite_entries_need_no_retry() -> None:
    small = torch.tensor([1.0, math.nan, 3.0, math.inf])
    plan = ReductionPlan([DefaultProfile()])
    assert op_calls(lambda: plan.reduce([small, torch.ones(2, 3)]), "aten::aminmax") == 0
    m = plan.reduce([small])
    assert_exact(m, 0, small)
