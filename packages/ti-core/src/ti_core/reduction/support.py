"""Which tensors the default profile measures, which engine reduces them, how values are read.

The dtype tables here are shared by the reduction (:mod:`~ti_core.reduction.plan`) and the
histograms (:mod:`~ti_core.reduction.histograms`), so both measure and skip the same tensors.
"""

from __future__ import annotations

from typing import Final

import torch

EXACT_IN_FLOAT32: Final[frozenset[torch.dtype]] = frozenset(
    {torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.uint8}
)
"""Dtypes whose every value float32 holds exactly: widened to float32 before any arithmetic."""
READ_AS_FLOAT64: Final[frozenset[torch.dtype]] = frozenset(
    {torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}
)
"""Integer dtypes converted to float64 (as numpy does; beyond 2^53 they round)."""
SUPPORTED_DTYPES: Final[frozenset[torch.dtype]] = (
    frozenset({torch.float32, torch.float64}) | EXACT_IN_FLOAT32 | READ_AS_FLOAT64
)
"""Dtypes the default profile measures; any other dtype gives explained nulls."""

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, as in the ``dtype`` column."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def unsupported_reason(t: torch.Tensor) -> str | None:
    """Why the default profile cannot measure ``t``, or None when it can."""
    if t.layout != torch.strided:
        return f"unsupported layout {str(t.layout).removeprefix('torch.')}: only dense tensors"
    if t.dtype not in SUPPORTED_DTYPES:
        return (
            f"unsupported dtype {dtype_name(t.dtype)}: the default profile measures "
            "floating, integer and bool tensors"
        )
    if t.is_meta:
        return "meta tensor: it has no values to measure"
    return None


def uses_numpy(device: torch.device) -> bool:
    """Whether tensors on ``device`` are reduced with numpy on their (host) memory.

    CPU tensors are: numpy's SIMD sort, comparisons and compaction beat torch's CPU kernels
    there. Accelerator tensors use the torch engine, which stays on the device. Callers look
    this up through the module (``support.uses_numpy``), so tests can send CPU tensors down
    the torch engine.
    """
    return device.type == "cpu"


def flat_float(t: torch.Tensor) -> torch.Tensor:
    """``t`` (of a supported dtype) as a 1-D float32/float64 tensor holding exactly its values."""
    flat = t.detach().reshape(-1)
    if flat.dtype in EXACT_IN_FLOAT32:
        return flat.to(torch.float32)
    if flat.dtype in READ_AS_FLOAT64:
        return flat.to(torch.float64)
    return flat.contiguous()


__all__ = [
    "EXACT_IN_FLOAT32",
    "READ_AS_FLOAT64",
    "SUPPORTED_DTYPES",
    "dtype_name",
    "flat_float",
    "unsupported_reason",
    "uses_numpy",
]
