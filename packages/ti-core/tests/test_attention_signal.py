"""The ``attention`` signal: the logits of every ``scaled_dot_product_attention`` call inside a
selected module's forward, against logits computed by hand in numpy float64 (causal, boolean
and float masks, grouped-query heads, several calls); nothing intercepted on unsampled
forwards. HF GPT-2 and Llama: tests/test_attention_models.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from _core_helpers import assert_matches, reference, rows, stats
from torch import nn

from ti_core import EveryNForwardsSampler, MemorySink, observe
from ti_schema import DEFAULT_METRICS, DEFAULT_SIGNALS, STABILITY_METRICS
from ti_schema.testing import assert_history_conforms

SIGNALS = (*DEFAULT_SIGNALS, "attention")


class Attention(nn.Module):
    """Two attention calls per forward: causal self-attention, then attention under a given
    mask (boolean or float), grouped-query when ``kv_heads`` < ``heads``."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = nn.Linear(16, heads * dim)
        self.kv = nn.Linear(16, 2 * kv_heads * dim)
        self.mask: torch.Tensor | None = None
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(torch._C._is_torch_function_mode_enabled())
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        masked = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, scale=0.3, enable_gqa=True
        )
        return (causal + masked).transpose(1, 2).reshape(b, t, -1)


def with_attention(name: str, module: nn.Module) -> bool:
    """The leaf modules and the attention modules (the default selects leaves only)."""
    return isinstance(module, Attention) or not any(True for _ in module.children())


def logits_by_hand(
    q: np.ndarray, k: np.ndarray, scale: float, keep: np.ndarray, add: np.ndarray | None = None
) -> np.ndarray:
    k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    logits = np.einsum("bhld,bhsd->bhls", q, k) * scale
    if add is not None:
        logits = logits + add
    return logits[np.broadcast_to(keep, logits.shape)]


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_logits_equal_a_numpy_reference(mask_kind: str) -> None:
    torch.manual_seed(0)
    attention = Attention()
    model = nn.Sequential(nn.Linear(16, 16), attention, nn.Linear(32, 4))
    t = 6
    allowed = torch.rand(t, t) > 0.3
    allowed[:, 0] = True
    if mask_kind == "bool":
        attention.mask = allowed
    else:
        attention.mask = torch.where(allowed, torch.randn(t, t) * 0.1, float("-inf"))
    x = torch.randn(2, t, 16)
    sink = MemorySink()
    every_other = EveryNForwardsSampler(2)  # forwards 0 and 2 sampled, 1 and 3 not
    with observe(
        model,
        output_dir=None,
        sink=sink,
        sampler=every_other,
        signals=SIGNALS,
        selector=with_attention,
        error_policy="raise",
    ):
        for _ in range(4):
            model(x).sum().backward()
    assert attention.modes == [True, False, True, False]  # nothing intercepted unsampled
    table = sink.table()
    assert_history_conforms(table)
    paths = {(r["layer"], r["tensor_path"]) for r in rows(table, signal="attention")}
    assert paths == {("1", "sdpa[0]"), ("1", "sdpa[1]")}
    assert {r["sample_id"] for r in rows(table, signal="attention")} == {0, 1}
    with torch.no_grad():
        h = model[0](x)
        q = attention.q(h).view(2, t, 4, 8).transpose(1, 2).double().numpy()
        k = attention.kv(h).view(2, t, 2, 2, 8).unbind(2)[0].transpose(1, 2).double().numpy()
    causal = logits_by_hand(q, k, 1 / math.sqrt(8), np.tril(np.ones((t, t), dtype=bool)))
    mask = attention.mask.numpy()
    if mask_kind == "bool":
        masked = logits_by_hand(q, k, 0.3, mask)
    else:
        masked = logits_by_hand(q, k, 0.3, ~np.isneginf(mask), mask.astype(np.float64))
    for path, values in (("sdpa[0]", causal), ("sdpa[1]", masked)):
        got = stats(table, signal="attention", sample_id=0, tensor_path=path)
        assert_matches(got, reference(values), rtol=1e-9)
        (count,) = {r["shape"][0] for r in rows(table, signal="attention", tensor_path=path)}
        assert count == values.size


def test_calls_outside_the_selected_modules_are_not_recorded() -> None:
    attention = Attention()
    model = nn.Sequential(nn.Linear(16, 16), attention)
    sink = MemorySink()
    only_linear = lambda name, module: isinstance(module, nn.Linear)  # noqa: E731
    with observe(model, output_dir=None, sink=sink, selector=only_linear, signals=SIGNALS):
        model(torch.randn(1, 3, 16))
    assert not rows(sink.table(), signal="attention")


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_a_call_over_the_logit_budget_is_measured_in_blocks(
    mask_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the budget at 20 logits, every call is measured a few query rows at a time: mean,
    std, extremes, fractions, rms and max_abs equal the whole logits' (numpy float64); the
    quartiles are null with the reason."""
    from ti_core.capture import attention as capture

    monkeypatch.setattr(capture, "MAX_LOGITS", 20)
    torch.manual_seed(0)
    attention = Attention()
    model = nn.Sequential(nn.Linear(16, 16), attention)
    t = 6
    allowed = torch.rand(t, t) > 0.3
    allowed[:, 0] = True
    attention.mask = (
        allowed
        if mask_kind == "bool"
        else torch.where(allowed, torch.randn(t, t) * 0.1, float("-inf"))
    )
    x = torch.randn(2, t, 16)
    sink = MemorySink()
    metrics = (*DEFAULT_METRICS, *STABILITY_METRICS)
    with observe(
        model,
        output_dir=None,
        sink=sink,
        signals=SIGNALS,
        selector=with_attention,
        metrics=metrics,
        error_policy="raise",
    ):
        model(x)
    table = sink.table()
    assert_history_conforms(table)
    with torch.no_grad():
        h = model[0](x)
        q = attention.q(h).view(2, t, 4, 8).transpose(1, 2).double().numpy()
        k = attention.kv(h).view(2, t, 2, 2, 8).unbind(2)[0].transpose(1, 2).double().numpy()
    mask = attention.mask.numpy()
    causal = logits_by_hand(q, k, 1 / math.sqrt(8), np.tril(np.ones((t, t), dtype=bool)))
    if mask_kind == "bool":
        masked = logits_by_hand(q, k, 0.3, mask)
    else:
        masked = logits_by_hand(q, k, 0.3, ~np.isneginf(mask), mask.astype(np.float64))
    for path, values in (("sdpa[0]", causal), ("sdpa[1]", masked)):
        got = stats(table, signal="attention", tensor_path=path)
        want = reference(values)
        exact = {
            **{m: want[m] for m in want if m not in ("p25", "p50", "p75")},
            "rms": float(np.sqrt((values**2).mean())),
            "max_abs": float(np.abs(values).max()),
        }
        assert_matches(got, exact, rtol=1e-9)
        found = rows(table, signal="attention", tensor_path=path)
        assert {r["shape"][0] for r in found} == {values.size}
        reasons = {r["metric"]: r["unavailable_reason"] for r in found if r["value"] is None}
        assert set(reasons) == {"p25", "p50", "p75", "kurtosis"}
        assert all(
            r.startswith(f"not computed: this call's {2 * 4 * t * t} attention")
            for r in reasons.values()
        )
