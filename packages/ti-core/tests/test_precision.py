"""The precision profile against torch's own casts, to the entry, on every engine path.

The oracle of each fraction is ``x.to(F)`` on the tensor itself (for ``mxfp8_e4m3`` on the
block-scaled tensor); the tensors sit on every boundary of every format (halfway points
between subnormals, the smallest subnormal and half of it, the smallest normal and the
points around it, the largest finite value and the next float above, -0.0, NaN and inf), in
float32, float16, bfloat16 and float64 sources, batched and above the large-tensor threshold,
through the numpy and the torch engine. Then real training steps: a bf16-autocast step and a
deep stack whose output gradients underflow float8_e4m3fn.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ti_core import (
    DefaultProfile,
    EveryNForwardsSampler,
    MemorySink,
    Reducer,
    default_reducers,
    inject_observer,
    remove_observer,
)
from ti_core.reduction import ReductionPlan
from ti_core.reduction.precision import CHUNK, precision_engines, target_dtype
from ti_schema import PRECISION_FORMATS

FORMATS = PRECISION_FORMATS
ENGINES = precision_engines(FORMATS)
PLAN = ReductionPlan([DefaultProfile(ENGINES.metrics.names, ENGINES)])
SOURCES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _smallest_subnormal(dtype: torch.dtype) -> float:
    bits = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
    return float(torch.tensor([1], dtype=bits).view(dtype).to(torch.float64))


def _boundary_points() -> torch.Tensor:
    """float64 values on and around every format's boundaries."""
    pts: list[float] = [0.0, -0.0, math.nan, math.inf, -math.inf, 1.0, -3.5]
    for name in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
        dtype = getattr(torch, name)
        info = torch.finfo(dtype)
        s, tiny, top = _smallest_subnormal(dtype), info.tiny, info.max
        ulp_top = top * info.eps / 2  # the spacing just below max... and half of it above
        for v in (
            s,
            s / 2,
            s / 4,
            0.75 * s,
            1.5 * s,  # halfway between s and 2s: rounds to even (2s)
            2.5 * s,
            3 * s,
            tiny,
            tiny - s,
            tiny - s / 2,  # halfway between the largest subnormal and tiny
            tiny + s / 2,
            top,
            top + ulp_top / 2,
            top + ulp_top,
            top * 2,
            top / 2,
        ):
            pts += [v, -v]
    return torch.tensor(pts, dtype=torch.float64)


def _neighbours(t: torch.Tensor) -> torch.Tensor:
    """``t`` and, for each finite non-zero entry, the next value up and down in its dtype."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize]
    finite = t[torch.isfinite(t) & (t != 0)]
    raw = finite.contiguous().view(bits)
    up, down = (raw + 1).view(t.dtype), (raw - 1).view(t.dtype)
    return torch.cat([t, up, down])


def boundary_tensor(source: torch.dtype) -> torch.Tensor:
    """Every boundary point in ``source`` (rounded to it) and its neighbours there."""
    return _neighbours(_boundary_points().to(source))


def _oracle(x: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    """(underflow, subnormal, overflow) counts from torch's own cast."""
    dtype = target_dtype(fmt)
    info = torch.finfo(dtype)
    x64 = x.to(torch.float64)
    finite = torch.isfinite(x64)
    if fmt == "mxfp8_e4m3":
        last = x.shape[-1] if x.dim() else 1
        rows = x64.reshape(-1, last)
        pad = -last % 32
        rows = torch.nn.functional.pad(rows, (0, pad), value=0.0)
        blocks = rows.reshape(rows.shape[0], -1, 32)
        amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(-1, keepdim=True)
        exponent = torch.tensor(
            [[math.frexp(float(a))[1] - 1 for a in row] for row in amax.reshape(amax.shape[0], -1)],
            dtype=torch.float64,
        ).reshape(amax.shape)
        scale = torch.pow(2.0, (exponent - 8).clamp(-127, 127))
        scaled = (blocks / scale).reshape(rows.shape)[:, :last].reshape(x.shape)
        x64, values = scaled, scaled
    else:
        values = x
    cast = values.to(dtype).to(torch.float64)
    nonzero = finite & (x.to(torch.float64) != 0)
    under = int((nonzero & (cast == 0)).sum())
    sub = int((torch.isfinite(cast) & (cast != 0) & (cast.abs() < info.tiny)).sum())
    over = int((finite & (x64.abs() > info.max)).sum())
    return under, sub, over


def _check(tensors: list[torch.Tensor]) -> None:
    got = PLAN.reduce(tensors)
    names = PLAN.metric_names
    assert not got.errors, got.errors
    for i, x in enumerate(tensors):
        n = x.numel()
        for fmt in FORMATS:
            want = _oracle(x, fmt)
            for which, metric in enumerate(("underflow", "subnormal", "overflow")):
                col = names.index(f"{metric}_fraction.{fmt}")
                assert got.available[i, col], (i, fmt, metric, got.reasons[i][col])
                assert round(got.values[i, col] * n) == want[which], (i, x.dtype, fmt, metric)
                assert got.values[i, col] == want[which] / n
        col = names.index("min_abs_nonzero")
        x64 = x.to(torch.float64)
        keep = torch.isfinite(x64) & (x64 != 0)
        if keep.any():
            assert got.values[i, col] == float(x64[keep].abs().min())
        else:
            assert not got.available[i, col]


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = []
    for source in SOURCES:
        b = boundary_tensor(source)
        out.append(b)
        out.append(b[:33].reshape(3, 11))  # blocks shorter than 32, several rows
        out.append(b[:300])  # batched with ``b``, NaN-padded to its width: the sorted route
        # random magnitudes across every format's range, both signs
        r = torch.randn(4, 96, generator=g, dtype=torch.float64)
        r = r * torch.pow(10.0, torch.empty(4, 96, dtype=torch.float64).uniform_(-45, 40))
        out.append(r.to(source))
    return out


def test_batched_rows_match_torch_casts_numpy_engine() -> None:
    _check(_cases())


def test_batched_rows_match_torch_casts_torch_engine(torch_engine: None) -> None:
    _check(_cases())


def _large(source: torch.dtype, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    b = boundary_tensor(source)
    noise = torch.randn(size, generator=g, dtype=torch.float64)
    noise = noise * torch.pow(10.0, torch.empty(size, dtype=torch.float64).uniform_(-45, 40))
    x = noise.to(source)
    x[: b.numel()] = b
    x[7 * b.numel() : 8 * b.numel()] = b  # again, at another block offset
    return x.reshape(-1, 96) if size % 96 == 0 else x


@pytest.mark.parametrize("source", SOURCES)
def test_large_tensors_match_torch_casts_numpy_engine(source: torch.dtype) -> None:
    _check([_large(source, 70_080)])  # over the batching limit: the one-pass path


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_large_tensors_match_torch_casts_torch_engine(
    torch_engine: None, source: torch.dtype
) -> None:
    _check([_large(source, 70_080), _large(source, 70_001)])


def test_tensors_over_the_chunk_size_are_exact() -> None:
    x = _large(torch.float32, CHUNK * 2 + 96 * 3)
    _check([x])


def test_tensors_over_the_chunk_size_are_exact_torch_engine(torch_engine: None) -> None:
    x = _large(torch.float32, CHUNK * 2 + 96 * 3)
    _check([x])


def test_no_finite_or_no_nonzero_entries() -> None:
    tensors = [torch.zeros(6), torch.tensor([math.nan, math.inf]), torch.tensor([-0.0, 0.0])]
    got = PLAN.reduce(tensors)
    col = PLAN.metric_names.index("min_abs_nonzero")
    assert got.reasons[0][col] == "no non-zero finite entries"
    assert got.reasons[1][col] == "no finite entries"
    assert got.reasons[2][col] == "no non-zero finite entries"
    for i in range(3):
        for j, name in enumerate(PLAN.metric_names):
            if "." in name:
                assert got.available[i, j]
                assert got.values[i, j] == 0.0


def test_unknown_format_is_refused_at_attach() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match=r"precision= names unknown format\(s\) \['fp8'\].*"
        r"'bfloat16'.*'mxfp8_e4m3'",
    ):
        inject_observer(model, sink=MemorySink(), output_dir=None, precision=("fp8",))
    with pytest.raises(TypeError, match="precision= must be a collection"):
        inject_observer(model, sink=MemorySink(), output_dir=None, precision="bfloat16")
    with pytest.raises(ValueError, match="has no DefaultProfile"):
        inject_observer(
            model,
            sink=MemorySink(),
            output_dir=None,
            precision=("bfloat16",),
            reducers=[Reducer("abs_max", lambda t: t.abs().max())],
        )
    with pytest.raises(ValueError, match="reserved for the precision metrics"):
        ReductionPlan([*default_reducers(), Reducer("underflow_fraction.fp4", lambda t: 0.0)])
    assert not hasattr(model, "_ti_observer")


def _rows(sink: MemorySink) -> list[dict[str, object]]:
    return sink.table().to_pylist()


def test_precision_unset_changes_nothing() -> None:
    assert ReductionPlan(default_reducers()).metric_names == DefaultProfile().names


def _keep_output_gradients(
    model: nn.Module,
) -> tuple[dict[str, torch.Tensor], list[RemovableHandle]]:
    """The oracle's copy of each child's output gradient, and the hook handles."""
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_in: object, grad_out: tuple[torch.Tensor, ...]) -> None:
            captured[name] = grad_out[0].detach().clone()

        return hook

    handles = [m.register_full_backward_hook(keep(n)) for n, m in model.named_children()]
    return captured, handles


def _underflow_row(rows: list[dict[str, object]], layer: str, fmt: str) -> dict[str, object]:
    (row,) = [
        r
        for r in rows
        if r["layer"] == layer
        and r["signal"] == "output_gradient"
        and r["metric"] == f"underflow_fraction.{fmt}"
    ]
    return row


def test_gradients_of_a_deep_stack_underflow_fp8() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(32, 1))
    captured, handles = _keep_output_gradients(model)
    sink = MemorySink()
    inject_observer(
        model,
        sink=sink,
        output_dir=None,
        sampler=EveryNForwardsSampler(1),
        precision=("bfloat16", "float8_e4m3fn"),
    )
    try:
        x = torch.randn(16, 32, requires_grad=True)
        loss = model(x).sum() * 1e-6  # a tiny output scale: every gradient is tiny
        loss.backward()
    finally:
        remove_observer(model)
        for h in handles:
            h.remove()
    rows = _rows(sink)
    assert len(captured) == len(layers) + 1
    for name, grad in captured.items():
        under, _, _ = _oracle(grad, "float8_e4m3fn")
        assert under > 0  # the oracle: a cast to float8_e4m3fn flushes some of it
        assert _underflow_row(rows, name, "float8_e4m3fn")["value"] == under / grad.numel()
        assert _underflow_row(rows, name, "bfloat16")["value"] == 0.0  # float32's range


def test_a_bf16_autocast_training_step_against_the_oracle() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    captured, handles = _keep_output_gradients(model)
    sink = MemorySink()
    inject_observer(
        model,
        sink=sink,
        output_dir=None,
        sampler=EveryNForwardsSampler(1),
        precision=("float8_e4m3fn", "float8_e5m2", "mxfp8_e4m3"),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(32, 64, requires_grad=True))
        loss = out.float().square().mean() * 1e-4
        opt.zero_grad()
        loss.backward()
        opt.step()
    finally:
        remove_observer(model)
        for h in handles:
            h.remove()
    rows = _rows(sink)
    seen = 0
    for name, grad in captured.items():
        for fmt in ("float8_e4m3fn", "float8_e5m2", "mxfp8_e4m3"):
            under, _, _ = _oracle(grad, fmt)
            row = _underflow_row(rows, name, fmt)
            assert row["dtype"] == str(grad.dtype).removeprefix("torch.")
            assert row["value"] == under / grad.numel(), (name, fmt)
            seen += under
    assert seen > 0  # the oracle says some gradient entries underflow fp8, and so do the rows
