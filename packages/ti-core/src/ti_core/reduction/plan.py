"""The reduction plan: the exact default metric profile and custom named metrics.

A :class:`ReductionPlan` turns the tensors of one sample and signal into a :class:`Measurements`
matrix (tensor x metric); docs/metrics.md defines every metric and its exactness. The default
profile runs on each tensor's own device, batched: small tensors of similar size are reduced
together as rows of one padded matrix, large ones one by one with exact selection instead of
full sorts (the numpy engine :mod:`~ti_core.reduction.numpy_rows` for CPU tensors, the torch
engine :mod:`~ti_core.reduction.torch_rows` elsewhere; both produce rows of the
:mod:`~ti_core.reduction.layout`). Every device's results travel to the host in one transfer
per :meth:`ReductionPlan.reduce` call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import torch

from ti_core.reduction import numpy_rows, support, torch_rows
from ti_core.reduction.engines import DEFAULT_ENGINES, ProfileEngines
from ti_core.reduction.numpy_rows import Moments
from ti_core.reduction.support import EXACT_IN_FLOAT32, dtype_name, flat_float, unsupported_reason
from ti_schema import DEFAULT_METRICS, metric_name_problem

__all__ = [
    "DefaultProfile",
    "Measurements",
    "Reducer",
    "ReducerSpec",
    "ReductionPlan",
    "default_reducers",
    "with_default_profile",
]


@dataclass(frozen=True)
class Reducer:
    """A custom scalar metric: ``fn(tensor)`` returns a 0-d tensor or a Python number.

    ``name`` becomes the value of the ``metric`` column, next to the default metrics.
    """

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor | float]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(
                f"Reducer(name=...) must be a non-empty string, got {self.name!r}; "
                "name the metric, e.g. Reducer('abs_max', lambda t: t.abs().max())"
            )
        if not callable(self.fn):
            raise TypeError(
                f"Reducer(fn=...) for metric {self.name!r} must be callable, got "
                f"{type(self.fn).__name__}; pass a function tensor -> number"
            )


@dataclass(frozen=True)
class DefaultProfile:
    """The built-in batched profile, ``ti_schema.DEFAULT_METRICS`` (or a subset of it).

    ``engines``: the metric declaration and its engine functions (a test may pass an extended
    copy, ``DEFAULT_ENGINES.extended(...)``; ``names`` are then drawn from it)."""

    names: tuple[str, ...] = DEFAULT_METRICS
    engines: ProfileEngines = DEFAULT_ENGINES


ReducerSpec = DefaultProfile | Reducer


def default_reducers() -> tuple[ReducerSpec, ...]:
    """The default reducers: the default metric profile alone."""
    return (DefaultProfile(),)


def with_default_profile(
    reducers: Sequence[ReducerSpec],
    change: Callable[[DefaultProfile], DefaultProfile],
    asked: str,
) -> tuple[ReducerSpec, ...]:
    """``reducers`` with every :class:`DefaultProfile` replaced by ``change(profile)`` (the
    run's choice of metrics or precision formats; ``asked`` says what it asks of the profile,
    for the error). The reducers' own errors come first; ValueError when there is no default
    profile to change."""
    ReductionPlan(reducers)
    if not any(isinstance(spec, DefaultProfile) for spec in reducers):
        raise ValueError(
            f"{asked}, but reducers= has no DefaultProfile; add one, e.g. "
            "reducers=[*default_reducers(), ...]"
        )
    return tuple(change(s) if isinstance(s, DefaultProfile) else s for s in reducers)


@dataclass
class Measurements:
    """Results of one :meth:`ReductionPlan.reduce` call, tensor by metric.

    ``values[i, j]`` is meaningful exactly where ``available[i, j]``; elsewhere
    ``reasons[i][j]`` says why the value is missing. ``errors`` holds exceptions raised while
    measuring (custom reducers, or an unexpected failure of the default profile); the caller
    applies its error policy to them.
    """

    values: np.ndarray
    available: np.ndarray
    reasons: list[list[str | None]]
    errors: list[BaseException]
    ordered: dict[int, tuple[np.ndarray, Moments]] = field(default_factory=dict)
    """Finite entries of tensor ``i`` in ascending order and their moments, where the reduction
    sorted them anyway (small CPU tensors): a histogram of the same tensor is counted from
    them (``compute_histograms(ordered=)``), without another pass."""
    moments: dict[int, Moments] = field(default_factory=dict)
    """Moments of tensor ``i`` from its one-pass reduction (large CPU tensors): a histogram of
    the same values needs no moments pass (``compute_histograms(moments=)``)."""


_LARGE: Final = 1 << 16
"""Tensors with more entries are reduced one by one with selection; smaller ones are batched."""

_BATCH_ELEMENTS: Final = 1 << 20
"""At most this many padded entries per batched matrix, bounding temporary memory."""

EMPTY_REASON: Final = "empty tensor (numel=0)"
NO_FINITE_REASON: Final = "no finite entries"
OVERFLOW_REASON: Final = "overflow: the result is not finite in float64"


class ReductionPlan:
    """Validated reducers of one observer, and the batched reduction of a sample's tensors."""

    def __init__(self, reducers: Sequence[ReducerSpec]) -> None:
        if isinstance(reducers, (DefaultProfile, Reducer, str)) or not isinstance(
            reducers, Sequence
        ):
            raise TypeError(
                f"reducers must be a sequence of DefaultProfile/Reducer, got "
                f"{type(reducers).__name__}; pass e.g. "
                "reducers=[*default_reducers(), Reducer('name', fn)]"
            )
        if len(reducers) == 0:
            raise ValueError(
                "reducers is empty, so nothing would be measured; pass default_reducers() "
                "or at least one Reducer"
            )
        names: list[str] = []
        self.engines = DEFAULT_ENGINES
        self._default_names: tuple[str, ...] = ()
        self._default_cols: list[int] = []  # profile-row column of each emitted default metric
        self._default_out: list[int] = []  # output column of each emitted default metric
        self._custom: list[tuple[int, Reducer]] = []
        for i, spec in enumerate(reducers):
            if isinstance(spec, DefaultProfile):
                if self._default_names:
                    raise ValueError(
                        f"reducers[{i}] repeats DefaultProfile; list the default profile once"
                    )
                known = spec.engines.metrics.names
                bad = [n for n in spec.names if n not in known]
                if bad or not spec.names or isinstance(spec.names, str):
                    raise ValueError(
                        f"reducers[{i}]: DefaultProfile(names={spec.names!r}) must be a "
                        f"non-empty tuple drawn from {known}; unknown: {bad}"
                    )
                self.engines = spec.engines
                self._default_names = tuple(spec.names)
                for n in spec.names:
                    self._default_cols.append(spec.engines.layout.index(n))
                    self._default_out.append(len(names))
                    names.append(n)
            elif isinstance(spec, Reducer):
                if not isinstance(spec.name, str) or not spec.name:
                    raise TypeError(
                        f"reducers[{i}].name must be a non-empty string, got {spec.name!r}"
                    )
                problem = metric_name_problem(spec.name)
                if problem is not None:
                    raise ValueError(
                        f"reducers[{i}]: {problem}; such names are reserved for the precision "
                        "metrics (inject_observer(precision=...)); name the Reducer otherwise"
                    )
                self._custom.append((len(names), spec))
                names.append(spec.name)
            else:
                raise TypeError(
                    f"reducers[{i}] is a {type(spec).__name__}; each item must be "
                    "DefaultProfile() or Reducer(name, fn)"
                )
        over_finite = self.engines.layout.over_finite
        self._over_finite = np.array([c in over_finite for c in self._default_cols], dtype=bool)
        profile = self.engines.metrics
        self._null_reasons = [
            profile.get(n).null_reason or OVERFLOW_REASON for n in self._default_names
        ]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"reducers name the metric(s) {dupes} more than once; give every Reducer a "
                "unique name that is not also a default metric"
            )
        self.metric_names: tuple[str, ...] = tuple(names)

    @property
    def default_only(self) -> bool:
        """No custom reducer: every metric comes from the built-in default profile."""
        return not self._custom

    def reduce(self, tensors: Sequence[torch.Tensor], *, parallel: bool = False) -> Measurements:
        """Measure every tensor with every reducer; never raises for a tensor's content.

        ``parallel``: the caller waits for the result (the training thread), so a pass over a
        large CPU tensor may use a helper thread (``numpy_rows.in_halves``)."""
        n, m = len(tensors), len(self.metric_names)
        values = np.full((n, m), np.nan, dtype=np.float64)
        available = np.zeros((n, m), dtype=bool)
        reasons: list[list[str | None]] = [[None] * m for _ in range(n)]
        errors: list[BaseException] = []
        out = _Output(values, available, reasons, errors, {}, {})
        with torch.no_grad():
            pending = _Pending(self.engines, parallel)
            if self._default_names:
                self._run_default(tensors, pending, out)
            for col, spec in self._custom:
                self._run_custom(tensors, col, spec, pending, out)
            pending.transfer(self, tensors, out)
        return Measurements(values, available, reasons, errors, out.ordered, out.moments)

    # -- default profile ---------------------------------------------------------------------

    def _run_default(
        self, tensors: Sequence[torch.Tensor], pending: _Pending, out: _Output
    ) -> None:
        # Tensors of one kind (device, shape, dtype, layout) share every decision below, so
        # the per-tensor Python work is a dictionary append.
        kinds: dict[tuple[torch.device, torch.Size, torch.dtype, torch.layout], list[int]] = {}
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                self._fail_default(out, i, f"not a tensor: {type(t).__name__}")
                continue
            key = (t.device, t.shape, t.dtype, t.layout)
            same = kinds.get(key)
            if same is None:
                kinds[key] = [i]
            else:
                same.append(i)
        # (device, size class) -> (shape, dtype) -> tensor indices. Size classes are powers of
        # two, so padding a batch to its widest member at most doubles it.
        small: dict[tuple[torch.device, int], dict[tuple[torch.Size, torch.dtype], list[int]]] = {}
        for (device, shape, dtype, _), idx in kinds.items():
            why = unsupported_reason(tensors[idx[0]])
            numel = math.prod(shape)
            if why is not None or numel == 0:
                for i in idx:
                    self._fail_default(out, i, why or EMPTY_REASON)
            elif numel > _LARGE:
                for i in idx:
                    try:
                        pending.add_large(i, tensors[i], out)
                    except Exception as exc:  # telemetry must not break training
                        self._fail_defaults(out, [i], exc)
            else:
                by_shape = small.setdefault((device, (numel - 1).bit_length()), {})
                by_shape[(shape, dtype)] = idx
        for (device, _), by_shape in small.items():
            for batch in _batches(by_shape):
                idx = [i for part in batch for i in part]
                try:
                    parts = [[tensors[i] for i in part] for part in batch]
                    if support.uses_numpy(device):
                        rows = _host_rows(parts, idx, out.ordered, self.engines)
                        pending.add_host_rows(idx, rows)
                    else:
                        engines = self.engines
                        rows_t = torch_rows.batched_rows(
                            parts, device, engines.layout, engines.torch
                        )
                        pending.add_rows(device, idx, rows_t)
                except Exception as exc:
                    self._fail_defaults(out, idx, exc)

    def _fail_defaults(self, out: _Output, idx: list[int], exc: Exception) -> None:
        out.errors.append(exc)
        for i in idx:
            self._fail_default(out, i, f"{type(exc).__name__}: {exc}")

    def _fail_default(self, out: _Output, i: int, reason: str) -> None:
        for col in self._default_out:
            out.available[i, col] = False
            out.reasons[i][col] = reason

    def _fill_default(self, out: _Output, idx: list[int], block: np.ndarray) -> None:
        """Write the profile rows (:mod:`~ti_core.reduction.layout`) of tensors ``idx``."""
        rows = np.asarray(idx)
        cols = np.asarray(self._default_out)
        vals = block[:, self._default_cols]
        finite_count = self.engines.layout.finite_count
        no_finite = (block[:, finite_count] <= 0)[:, None] & self._over_finite[None, :]
        ok = np.isfinite(vals) & ~no_finite
        # + 0.0 writes every zero as +0.0: which of -0.0 and +0.0 an order statistic picks from
        # a tensor holding both depends on the sort or selection code numpy dispatches to for
        # this CPU (AVX-512 or not), and the rows must not.
        out.values[rows[:, None], cols[None, :]] = np.where(ok, vals + 0.0, np.nan)
        out.available[rows[:, None], cols[None, :]] = ok
        for r, c in zip(*np.nonzero(~ok), strict=True):
            reason = NO_FINITE_REASON if no_finite[r, c] else self._null_reasons[c]
            out.reasons[idx[r]][self._default_out[c]] = reason

    # -- custom reducers ---------------------------------------------------------------------

    def _run_custom(
        self,
        tensors: Sequence[torch.Tensor],
        col: int,
        spec: Reducer,
        pending: _Pending,
        out: _Output,
    ) -> None:
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.numel() == 0:
                out.reasons[i][col] = EMPTY_REASON
                continue
            try:
                result = spec.fn(t)
                if isinstance(result, torch.Tensor):
                    if result.numel() != 1 or result.is_complex():
                        raise TypeError(
                            f"Reducer {spec.name!r} returned a {dtype_name(result.dtype)} tensor "
                            f"of shape {tuple(result.shape)}; return a real 0-d tensor or a number"
                        )
                    pending.add_custom(
                        i, col, spec.name, result.detach().reshape(()).to(torch.float64)
                    )
                else:
                    _store_custom(out, i, col, spec.name, float(result))
            except Exception as exc:  # a failing reducer is a null with a reason, not a crash
                out.errors.append(exc)
                out.reasons[i][col] = f"{type(exc).__name__}: {exc}"


@dataclass
class _Output:
    values: np.ndarray
    available: np.ndarray
    reasons: list[list[str | None]]
    errors: list[BaseException]
    ordered: dict[int, tuple[np.ndarray, Moments]]
    moments: dict[int, Moments]


def _store_custom(out: _Output, i: int, col: int, name: str, v: float) -> None:
    if math.isfinite(v):
        out.values[i, col] = v
        out.available[i, col] = True
        out.reasons[i][col] = None
    else:
        out.reasons[i][col] = f"Reducer {name!r} returned {v}"


class _Pending:
    """Device-side results waiting for the single transfer per device."""

    def __init__(self, engines: ProfileEngines, parallel: bool = False) -> None:
        self.engines = engines
        self.width = engines.layout.width
        self.parallel = parallel
        self.rows: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        self.host: list[tuple[list[int], np.ndarray]] = []
        self.retry: set[int] = set()  # large accelerator tensors computed optimistically
        self.custom: dict[torch.device, list[tuple[int, int, str, torch.Tensor]]] = {}

    def add_rows(self, device: torch.device, idx: list[int], rows: torch.Tensor) -> None:
        self.rows.setdefault(device, []).append((idx, rows))

    def add_host_rows(self, idx: list[int], rows: np.ndarray) -> None:
        """Rows already in host memory (numpy reductions): no transfer, no torch calls."""
        self.host.append((idx, rows))

    def add_large(self, i: int, t: torch.Tensor, out: _Output) -> None:
        engines = self.engines
        if support.uses_numpy(t.device):
            flat = flat_float(t).numpy()
            row, out.moments[i] = numpy_rows.reduce_large(
                flat, self.parallel, engines.layout, engines.numpy, _last_dim(t)
            )
            self.add_host_rows([i], row.reshape(1, self.width))
        else:
            row_t = torch_rows.large_row_optimistic(
                flat_float(t), engines.layout, engines.torch, _last_dim(t)
            )
            self.retry.add(i)
            self.add_rows(t.device, [i], row_t.reshape(1, self.width))

    def add_custom(self, i: int, col: int, name: str, value: torch.Tensor) -> None:
        self.custom.setdefault(value.device, []).append((i, col, name, value))

    def transfer(self, plan: ReductionPlan, tensors: Sequence[torch.Tensor], out: _Output) -> None:
        for idx, block in self.host:
            plan._fill_default(out, idx, block)
        for device in {*self.rows, *self.custom}:
            groups = self.rows.get(device, [])
            customs = self.custom.get(device, [])
            parts = [rows.reshape(-1) for _, rows in groups]
            parts += [v.reshape(1) for _, _, _, v in customs]
            try:
                host = torch.cat(parts).cpu().numpy()  # the one device-to-host transfer
            except Exception as exc:
                out.errors.append(exc)
                reason = f"{type(exc).__name__}: {exc}"
                for idx, _ in groups:
                    for i in idx:
                        plan._fail_default(out, i, reason)
                for i, col, _, _ in customs:
                    out.reasons[i][col] = reason
                continue
            pos = 0
            for idx, rows in groups:
                block = host[pos : pos + rows.numel()].reshape(len(idx), self.width)
                pos += rows.numel()
                plan._fill_default(out, idx, block)
                finite_count = self.engines.layout.finite_count
                for k, i in enumerate(idx):
                    if i in self.retry and block[k, finite_count] != tensors[i].numel():
                        row = _retry_exact(plan, out, i, tensors[i])
                        if row is not None:
                            plan._fill_default(out, [i], row.reshape(1, self.width))
            for i, col, name, _ in customs:
                _store_custom(out, i, col, name, float(host[pos]))
                pos += 1


def _retry_exact(plan: ReductionPlan, out: _Output, i: int, t: torch.Tensor) -> np.ndarray | None:
    # An accelerator tensor with non-finite entries: its optimistic order statistics assumed
    # none, so redo it exactly (this costs extra synchronizations, only in this case).
    try:
        engines = plan.engines
        row = torch_rows.large_row_exact(flat_float(t), engines.layout, engines.torch, _last_dim(t))
        return row.cpu().numpy()
    except Exception as exc:
        out.errors.append(exc)
        plan._fail_default(out, i, f"{type(exc).__name__}: {exc}")
        return None


def _last_dim(t: torch.Tensor) -> int:
    """The last dimension of ``t`` (1 for a 0-d tensor): what a block along it needs."""
    return t.shape[-1] if t.dim() else 1


# -- batched small tensors ---------------------------------------------------------------------


def _batches(by_shape: dict[tuple[torch.Size, torch.dtype], list[int]]) -> list[list[list[int]]]:
    """Split one size class into batches (lists of same shape-and-dtype parts) whose padded
    matrix stays under ``_BATCH_ELEMENTS`` entries."""
    width = max(math.prod(shape) for shape, _ in by_shape)
    per_batch = max(1, _BATCH_ELEMENTS // width)
    batches: list[list[list[int]]] = []
    cur: list[list[int]] = []
    room = per_batch
    for part in by_shape.values():
        while part:
            take, part = part[:room], part[room:]
            cur.append(take)
            room -= len(take)
            if room == 0:
                batches.append(cur)
                cur, room = [], per_batch
    if cur:
        batches.append(cur)
    return batches


def _host_rows(
    parts: list[list[torch.Tensor]],
    idx: Sequence[int],
    ordered: dict[int, tuple[np.ndarray, Moments]],
    engines: ProfileEngines,
) -> np.ndarray:
    """Default-profile rows of small CPU tensors, reduced together with numpy in float64.

    Each part holds tensors of one shape and dtype; the parts become the rows of one NaN-padded
    matrix (padding is neither finite nor zero). The sorted finite entries of the tensor at
    ``idx[r]`` (row ``r``) and their moments go to ``ordered``. Tensors of the matrix's dtype
    are copied in through numpy views: on the emission worker every torch call is a point where
    the GIL may go to the training thread for a while.
    """
    widths = [part[0].numel() for part in parts]
    width = max(widths)
    lengths = [w for part, w in zip(parts, widths, strict=True) for _ in part]
    # Sorting dominates: float32 sorts faster and holds these dtypes' values exactly.
    narrow = all(
        part[0].dtype in EXACT_IN_FLOAT32 or part[0].dtype == torch.float32 for part in parts
    )
    x = np.empty((len(lengths), width), dtype=np.float32 if narrow else np.float64)
    row = 0
    x_dtype = torch.float32 if narrow else torch.float64
    for part, w in zip(parts, widths, strict=True):
        if part[0].dtype == x_dtype:
            for k, t in enumerate(part):
                x[row + k, :w] = (t.detach() if t.requires_grad else t).numpy().reshape(w)
        else:
            block = torch.stack(part).detach().reshape(len(part), w)
            if block.dtype == torch.bfloat16:  # numpy has no bfloat16
                block = block.float()
            x[row : row + len(part), :w] = block.numpy()
        if w < width:
            x[row : row + len(part), w:] = math.nan
        row += len(part)
    lay = engines.layout
    dims = [float(part[0].shape[-1] if part[0].dim() else 1) for part in parts for _ in part]
    rows, keys = numpy_rows.batched_rows(
        x,
        np.asarray(lengths, dtype=np.float64),
        lay,
        engines.numpy,
        np.asarray(dims, dtype=np.float64),
    )
    finite = rows[:, lay.finite_count].astype(np.intp).tolist()
    r = 0
    for part, w in zip(parts, widths, strict=True):
        for _ in part:
            ordered[idx[r]] = (keys[r, : finite[r]], numpy_rows.row_moments(rows[r], w, lay))
            r += 1
    return rows
