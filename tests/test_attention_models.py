"""The ``attention`` signal on real models: HF GPT-2 and Llama from configs (sdpa attention),
their attention modules selected; every call's logits equal the logits computed by hand in
numpy float64 from the query and key each call received (recorded by a function mode of the
test's own, beside the observer)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.overrides import TorchFunctionMode

from ti_core import AlwaysSampler, MemorySink, observe
from ti_schema import DEFAULT_METRICS
from ti_schema.testing import assert_history_conforms

transformers = pytest.importorskip("transformers")


class Recorded(TorchFunctionMode):
    """Every attention call's query, key, mask, causality, scale and grouping."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            self.calls.append(
                {
                    "q": bound["query"].detach().double().numpy(),
                    "k": bound["key"].detach().double().numpy(),
                    "mask": None
                    if bound.get("attn_mask") is None
                    else bound["attn_mask"].detach().numpy(),
                    "causal": bool(bound.get("is_causal", False)),
                    "scale": bound.get("scale"),
                    "gqa": bool(bound.get("enable_gqa", False)),
                }
            )
        return func(*args, **kwargs)


def by_hand(call: dict[str, Any]) -> np.ndarray:
    """The logits that take part in one call, numpy float64."""
    q, k = call["q"], call["k"]
    if call["gqa"] or k.shape[-3] != q.shape[-3]:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if call["scale"] is None else call["scale"]
    logits = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    keep = np.ones(logits.shape, dtype=bool)
    if call["causal"]:
        keep &= np.tril(np.ones(logits.shape[-2:], dtype=bool))
    mask = call["mask"]
    if mask is not None:
        if mask.dtype == np.bool_:
            keep &= mask
        else:
            logits = logits + mask.astype(np.float64)
            keep &= ~np.isneginf(mask)
    return logits[np.broadcast_to(keep, logits.shape)]


def profile(values: np.ndarray) -> dict[str, float]:
    quartiles = np.percentile(values, [25, 50, 75])
    return {
        "mean": values.mean(),
        "std": values.std(),
        "min": values.min(),
        "max": values.max(),
        "p25": quartiles[0],
        "p50": quartiles[1],
        "p75": quartiles[2],
        "zero_fraction": float(np.mean(values == 0)),
        "nonfinite_fraction": 0.0,
    }


def _model(kind: str) -> tuple[nn.Module, type]:
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

        config = transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16
        )
        config._attn_implementation = "sdpa"
        return transformers.GPT2LMHeadModel(config), GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=16,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config), LlamaAttention


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_attention_logits_of_hf_models_equal_the_logits_by_hand(kind: str) -> None:
    model, attention_type = _model(kind)
    model.eval()
    names = [n for n, m in model.named_modules() if isinstance(m, attention_type)]
    assert len(names) == 2

    def selector(name: str, module: nn.Module) -> bool:
        return isinstance(module, attention_type) or not any(True for _ in module.children())

    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    sink = MemorySink()
    recorded = Recorded()
    with (
        observe(
            model,
            output_dir=None,
            sink=sink,
            sampler=AlwaysSampler(),
            selector=selector,
            signals=("output", "attention"),
            error_policy="raise",
        ),
        recorded,
    ):
        model(input_ids=ids)
    table = sink.table()
    assert_history_conforms(table)
    rows = [r for r in table.to_pylist() if r["signal"] == "attention"]
    layers = sorted({(r["layer"], r["tensor_path"]) for r in rows})
    assert layers == [(name, "sdpa[0]") for name in sorted(names)]
    assert len(recorded.calls) == 2  # one call per attention module, in model order
    for name, call in zip(names, recorded.calls, strict=True):
        expected = profile(by_hand(call))
        got = {r["metric"]: r["value"] for r in rows if r["layer"] == name}
        assert set(got) == set(DEFAULT_METRICS)
        for metric, value in expected.items():
            assert got[metric] == pytest.approx(value, rel=1e-9, abs=1e-12), (kind, name, metric)
        count = by_hand(call).size
        assert {r["shape"][0] for r in rows if r["layer"] == name} == {count}
        assert count < ids.numel() * 4 * 12  # the causal mask left entries out
