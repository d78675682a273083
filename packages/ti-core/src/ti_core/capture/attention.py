"""``attention``: the attention logits of every ``scaled_dot_product_attention`` call made
inside a selected module's forward, on sampled root forwards (docs/capture.md, "Attention
logits").

Ownership: an :class:`AttentionCalls` per sampled root forward with the signal on, made with
its :class:`~ti_core.capture.sample.Sample`; its :class:`AttentionMode` (a
``TorchFunctionMode``) is entered on the sample's thread when the sample starts and exited when
it ends, so an unsampled forward runs with nothing intercepted. A call is attributed to the
innermost selected module whose frame is running (the Python stack, read only at an attention
call); a call inside no selected module's forward is not recorded.

Each call's logits ``q @ k^T * scale`` are computed again, in float64, from the call's own
``query`` and ``key`` (``enable_gqa``: the key's heads repeated), the causal or given mask
applied (a boolean mask keeps its ``True`` entries, a float mask is added and its ``-inf``
entries are left out), and the entries that take part are measured as one tensor by the
run's reduction, exactly. A call whose logits hold more than :data:`MAX_LOGITS` entries is
measured in blocks of query rows (:func:`blocked_logits`): memory never holds more than that
many logits at once; its mean, std, extremes, fractions, ``rms`` and ``max_abs`` are exact
(float64, merged block by block), the other metrics (quartiles, kurtosis) null with
:data:`BLOCKED_REASON`.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable
from typing import Any, Final

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.overrides import TorchFunctionMode

from ti_core.call_context import now_us
from ti_core.entries import Gaps
from ti_core.reduction.batch import TensorBatch
from ti_core.reduction.placement import SNAPSHOT_BUDGET_BYTES
from ti_core.reduction.support import dtype_name

MAX_LOGITS: Final[int] = SNAPSHOT_BUDGET_BYTES // 8
"""Float64 logits computed for one call at most (the snapshot budget's bytes)."""
BLOCKED_REASON: Final[str] = (
    "not computed: this call's {n} attention logits exceed the {limit} computed at once, so "
    "they were measured in blocks, where only mean, std, min, max, rms, max_abs and the "
    "fractions are exact (sample a shorter sequence or a smaller batch for the rest)"
)
BLOCKED_METRICS: Final[tuple[str, ...]] = (
    "mean",
    "std",
    "min",
    "max",
    "zero_fraction",
    "nonfinite_fraction",
    "rms",
    "max_abs",
)
"""What a call over :data:`MAX_LOGITS` gets, from its blocks (:class:`BlockMoments`)."""
_SDPA: Final = F.scaled_dot_product_attention
_ARGUMENTS: Final[tuple[str, ...]] = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)


def _grouped_keys(query: torch.Tensor, key: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
    """``key`` with its heads repeated to the query's (``enable_gqa``), detached."""
    key = key.detach()
    if enable_gqa and query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    return key


def _factor(width: int, scale: float | None) -> float:
    """The call's ``scale``, else ``1/sqrt(head dim)`` (as the attention function)."""
    return 1.0 / math.sqrt(width) if scale is None else float(scale)


def _apply_mask(
    logits: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A boolean ``mask`` keeps its ``True`` entries; a float one is added to the logits and
    its ``-inf`` entries are left out."""
    if mask is None:
        return logits, keep
    if mask.dtype == torch.bool:
        return logits, keep & mask
    return logits + mask.to(torch.float64), keep & ~torch.isneginf(mask)


def attention_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 logits of an attention call (``q @ k^T * scale``, a float mask added) and
    the boolean mask of the entries that take part, broadcast to the logits' shape."""
    q = query.detach().to(torch.float64)
    k = _grouped_keys(query, key, enable_gqa).to(torch.float64)
    logits = torch.matmul(q, k.transpose(-2, -1)) * _factor(q.shape[-1], scale)
    length, source = logits.shape[-2], logits.shape[-1]
    keep = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    if is_causal:
        keep = keep & torch.ones(length, source, dtype=torch.bool, device=logits.device).tril()
    mask = None if attn_mask is None else attn_mask.detach()
    logits, keep = _apply_mask(logits, keep, mask)
    return logits, keep.expand(logits.shape)


class BlockMoments:
    """Exact float64 statistics of a tensor seen a block at a time: counts, extremes, and the
    mean and centered sum of squares merged block by block (Chan et al.'s pairwise update)."""

    def __init__(self) -> None:
        self.count = 0
        self.finite = 0
        self.zeros = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.squares = 0.0
        self.lo = math.inf
        self.hi = -math.inf

    def add(self, values: torch.Tensor) -> None:
        """One block's entries (float64, 1-D)."""
        finite = values[torch.isfinite(values)]
        self.count += values.numel()
        self.zeros += int((values == 0).sum())
        n = finite.numel()
        if not n:
            return
        mean = float(finite.mean())
        m2 = float(((finite - mean) ** 2).sum())
        total = self.finite + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.finite * n / total
        self.finite = total
        self.squares += float((finite * finite).sum())
        self.lo = min(self.lo, float(finite.min()))
        self.hi = max(self.hi, float(finite.max()))

    def values(self) -> dict[str, float]:
        """The :data:`BLOCKED_METRICS` that exist (the fractions need entries, the rest finite
        ones)."""
        if not self.count:
            return {}
        out = {
            "zero_fraction": self.zeros / self.count,
            "nonfinite_fraction": (self.count - self.finite) / self.count,
        }
        if self.finite:
            out.update(
                mean=self.mean,
                std=math.sqrt(self.m2 / self.finite),
                min=self.lo,
                max=self.hi,
                rms=math.sqrt(self.squares / self.finite),
                max_abs=max(abs(self.lo), abs(self.hi)),
            )
        return out


def blocked_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    limit: int,
) -> BlockMoments:
    """The statistics of an attention call's logits that take part (as
    :func:`attention_logits`), computed a block of query rows at a time: never more than
    ``limit`` logits (and one query and key head) at once."""
    q, k = query.detach(), _grouped_keys(query, key, enable_gqa)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])  # type: ignore[no-untyped-call]
    length, source, width = q.shape[-2], k.shape[-2], q.shape[-1]
    q = q.expand(*batch, length, width)
    k = k.expand(*batch, source, width)
    mask = None if attn_mask is None else attn_mask.detach().expand(*batch, length, source)
    factor = _factor(width, scale)
    rows = max(1, limit // max(source, 1))
    columns = torch.arange(source, device=q.device)
    moments = BlockMoments()
    for index in itertools.product(*(range(n) for n in batch)):
        keys = k[index].to(torch.float64)
        for start in range(0, length, rows):
            stop = min(length, start + rows)
            logits = (q[index][start:stop].to(torch.float64) @ keys.T) * factor
            keep = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
            if is_causal:
                keep &= columns[None, :] <= torch.arange(start, stop, device=q.device)[:, None]
            part = None if mask is None else mask[index][start:stop]
            logits, keep = _apply_mask(logits, keep, part)
            moments.add(logits[keep])
    return moments


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(_ARGUMENTS, args, strict=False))
    bound.update(kwargs)
    return bound


class AttentionCalls:
    """The ``attention`` signal of one sampled root forward."""

    def __init__(
        self,
        layers: dict[int, int],
        calls: dict[int, int],
        batch: TensorBatch,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._layers = layers
        """id of a selected module -> its layer index."""
        self._calls = calls
        """The sample's completed calls per layer (the running call's index)."""
        self.batch = batch
        self.gaps = Gaps()
        self._seen: dict[tuple[int, int], int] = {}
        self._on_error = on_error
        self.mode = AttentionMode(self)

    def start(self) -> None:
        """Intercept attention calls on this thread (the sampled forward starts)."""
        self.mode.__enter__()  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        """Stop intercepting (the sampled forward ended, on the thread that started it)."""
        self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def _layer(self) -> tuple[int, nn.Module] | None:
        """The innermost selected module whose frame is running, and its layer."""
        frame = sys._getframe(1)
        layers = self._layers
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in layers and isinstance(owner, nn.Module):
                return layers[id(owner)], owner
            frame = frame.f_back  # type: ignore[assignment]
        return None

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An attention call inside the sampled forward: measure its logits."""
        try:
            found = self._layer()
            if found is None:
                return
            layer, module = found
            call = self._calls.get(layer, 0)
            index = self._seen.get((layer, call), 0)
            self._seen[(layer, call)] = index + 1
            bound = _bind(args, kwargs)
            query, key = bound["query"], bound["key"]
            stamp = now_us()
            path = f"sdpa[{index}]"
            heads = list(key.shape[:-2])
            if bound.get("enable_gqa") and heads and query.dim() >= 3:
                heads[-1] = query.shape[-3]  # the key's heads, repeated to the query's
            shape = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
                query.shape[:-2], torch.Size(heads)
            )
            count = math.prod(shape) * query.shape[-2] * key.shape[-2]
            grad_enabled = torch.is_grad_enabled()
            if count > MAX_LOGITS:
                moments = blocked_logits(
                    query,
                    key,
                    bound.get("attn_mask"),
                    bool(bound.get("is_causal", False)),
                    bound.get("scale"),
                    bool(bound.get("enable_gqa", False)),
                    MAX_LOGITS,
                )
                self.batch.add_measured(
                    moments.values(),
                    BLOCKED_REASON.format(n=count, limit=MAX_LOGITS),
                    (moments.count,),
                    dtype_name(torch.float64),
                    (layer, call, path, bool(module.training), grad_enabled, stamp),
                )
                return
            logits, keep = attention_logits(
                query,
                key,
                bound.get("attn_mask"),
                bool(bound.get("is_causal", False)),
                bound.get("scale"),
                bool(bound.get("enable_gqa", False)),
            )
            taking_part = logits.masked_select(keep)
            self.batch.add(
                taking_part, layer, call, path, bool(module.training), grad_enabled, stamp
            )
        except Exception as error:
            self._on_error(error)


class AttentionMode(TorchFunctionMode):
    """Hands every ``scaled_dot_product_attention`` call to :class:`AttentionCalls`, then runs
    it unchanged (torch disables the mode while its handler runs: the logits computed there
    are not intercepted)."""

    def __init__(self, calls: AttentionCalls) -> None:
        super().__init__()
        self._calls = calls

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            self._calls.record(args, kwargs)
        return func(*args, **kwargs)


__all__ = [
    "BLOCKED_METRICS",
    "BLOCKED_REASON",
    "MAX_LOGITS",
    "AttentionCalls",
    "AttentionMode",
    "BlockMoments",
    "attention_logits",
    "blocked_logits",
]
