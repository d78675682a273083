"""The quartiles of the default profile: numpy's "linear" quantile method, for every engine.

For ``n`` sorted values the quantile ``q`` sits at the virtual index ``q * (n - 1)`` and is
interpolated between its two neighbouring order statistics with numpy's ``_lerp``, which is
exact at both ends. The float, numpy-array and torch forms below compute the same expression,
so every engine gives numpy's bits.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import torch

QUANTILES: Final[tuple[float, ...]] = (0.25, 0.5, 0.75)
"""The quantiles of the ``p25``, ``p50``, ``p75`` metrics (``Rows.quartiles`` of both engines)."""


def quantile_positions(n: int) -> list[tuple[int, int, float]]:
    """``(lower rank, upper rank, fraction)`` of each quantile of ``n`` sorted values."""
    out = []
    for q in QUANTILES:
        pos = q * (n - 1)
        lo = math.floor(pos)
        frac = pos - lo
        hi = lo + 1 if frac > 0.0 and lo + 1 < n else lo
        out.append((lo, hi, frac))
    return out


def lerp(a: float, b: float, t: float) -> float:
    """numpy's ``_lerp`` of two floats: monotone, exact at both ends."""
    diff = b - a
    return b - diff * (1.0 - t) if t >= 0.5 else a + diff * t


def lerp_array(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """:func:`lerp`, element-wise over numpy arrays."""
    diff = b - a
    out: np.ndarray = np.where(t >= 0.5, b - diff * (1.0 - t), a + diff * t)
    return out


def lerp_tensor(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """:func:`lerp`, element-wise over tensors (on their device, without a synchronization)."""
    diff = b - a
    t_tensor = torch.as_tensor(t, dtype=diff.dtype, device=diff.device)
    return torch.where(t_tensor >= 0.5, b - diff * (1 - t_tensor), a + diff * t_tensor)


__all__ = ["QUANTILES", "lerp", "lerp_array", "lerp_tensor", "quantile_positions"]
