"""The dtype tables and value reading shared by the reduction and the histograms
(``ti_core.reduction.support``): which tensors are measured, how their values are read, and the
reasons users read for those that are not (docs/data-contract.md, "Reasons")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ti_core.reduction import layout, support

# Values that float32 cannot hold (2**24 + 1 and neighbours) where the dtype can.
_WIDE = {
    torch.int16: [-32768, 32767, 3, -7],
    torch.int32: [16_777_217, -16_777_219, 2**31 - 1, 0],
    torch.int64: [16_777_217, -(2**40) - 1, 2**53, 5],
    torch.uint16: [65_535, 1, 0, 40_001],
    torch.uint32: [16_777_217, 2**32 - 1, 0, 9],
    torch.uint64: [16_777_217, 2**53, 0, 11],
}


@pytest.mark.parametrize("dtype", sorted(support.READ_AS_FLOAT64, key=str))
def test_wide_integers_are_read_as_float64_exactly(dtype: torch.dtype) -> None:
    values = _WIDE[dtype]
    t = torch.tensor(values, dtype=torch.int64).to(dtype).reshape(2, 2)
    flat = support.flat_float(t)
    assert flat.dtype == torch.float64
    assert flat.shape == (4,)
    assert flat.tolist() == [float(v) for v in values]
    if dtype.itemsize >= 4:  # these values are beyond float32: it would round 16,777,217
        assert not np.array_equal(np.asarray(values, dtype=np.float32), np.asarray(values))


@pytest.mark.parametrize("dtype", sorted(support.EXACT_IN_FLOAT32, key=str))
def test_narrow_dtypes_are_widened_to_float32_exactly(dtype: torch.dtype) -> None:
    source = torch.tensor([[0.5, -2.0], [1.0, 3.0]]) if dtype.is_floating_point else None
    if dtype == torch.bool:
        t = torch.tensor([[True, False], [False, True]])
        want = [1.0, 0.0, 0.0, 1.0]
    elif source is not None:
        t = source.to(dtype)
        want = [0.5, -2.0, 1.0, 3.0]
    else:
        t = torch.tensor([[0, 127], [5, 100]], dtype=dtype)
        want = [0.0, 127.0, 5.0, 100.0]
    flat = support.flat_float(t)
    assert flat.dtype == torch.float32
    assert flat.tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_tensors_keep_their_dtype_and_are_made_contiguous(dtype: torch.dtype) -> None:
    base = torch.arange(12, dtype=dtype)
    for view in (base.reshape(3, 4).t(), base[::2]):  # reshape copies the first, not the second
        assert not view.is_contiguous()
        flat = support.flat_float(view)
        assert flat.dtype == dtype
        assert flat.is_contiguous()
        assert flat.tolist() == view.reshape(-1).tolist()


def test_reasons_for_tensors_the_default_profile_does_not_measure() -> None:
    assert support.unsupported_reason(torch.zeros(3)) is None
    sparse = torch.zeros(3, 3).to_sparse()
    assert support.unsupported_reason(sparse) == (
        "unsupported layout sparse_coo: only dense tensors"
    )
    assert support.unsupported_reason(torch.zeros(2, dtype=torch.complex64)) == (
        "unsupported dtype complex64: the default profile measures floating, integer and bool "
        "tensors"
    )
    assert support.unsupported_reason(torch.zeros(2, device="meta")) == (
        "meta tensor: it has no values to measure"
    )


def test_dtype_names_drop_the_torch_prefix() -> None:
    # float8_e5m2fnuz: a dtype no other test names, so the name is computed here, not cached
    assert support.dtype_name(torch.float8_e5m2fnuz) == "float8_e5m2fnuz"
    assert support.dtype_name(torch.float8_e5m2fnuz) == "float8_e5m2fnuz"  # cached
    assert support.dtype_name(torch.bfloat16) == "bfloat16"


def test_the_engine_follows_the_device() -> None:
    assert support.uses_numpy(torch.device("cpu"))
    assert not support.uses_numpy(torch.device("meta"))


@pytest.mark.parametrize("bins", [1, 30])
def test_histogram_row_slices_partition_the_row(bins: int) -> None:
    width = layout.histogram_width(bins)
    row = list(range(width))
    edges = row[layout.histogram_edges(bins)]
    counts = row[layout.histogram_counts(bins)]
    assert len(edges) == bins + 1
    assert len(counts) == bins
    assert row[: layout.HISTOGRAM_HEAD] + edges + counts == row  # nothing left over or shared
