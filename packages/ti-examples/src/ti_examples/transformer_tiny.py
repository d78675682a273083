"""A Hugging Face transformer built from a config, trained with its own loop, observed passively.

A two-layer GPT-2 with 32-wide embeddings is built from ``GPT2Config`` (no weights are
downloaded; ``HF_HUB_OFFLINE=1`` is set) and trained for a few AdamW steps on a synthetic
counting task (each token is the previous one plus one), which it starts learning at once. The
observer selects the leaf modules plus the model itself, every transformer block and every
attention module, so the history shows dict outputs (``['logits']``, ``['loss']``) and
tuple outputs (``[0]``) with their tensor paths.

Requires the ``transformers`` extra (``pip install "ti-examples[transformers]"``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ti_core import EveryNForwardsSampler, inject_observer, remove_observer

VOCAB_SIZE = 64
SEQUENCE_LENGTH = 16


@dataclass(frozen=True)
class TransformerResult:
    """Where the run wrote its artifacts and how its loss moved."""

    stats_dir: Path
    losses: list[float]
    selected_layers: list[str]


def build_model(seed: int = 0) -> nn.Module:
    """A tiny randomly initialized GPT-2 language model (two blocks, two heads, width 32)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=SEQUENCE_LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model: nn.Module = GPT2LMHeadModel(config)
    return model


def counting_batches(steps: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Sequences that count up from a random start (mod the vocabulary): learnable in steps."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(SEQUENCE_LENGTH)
    return [
        (torch.randint(0, VOCAB_SIZE, (batch_size, 1), generator=gen) + offsets) % VOCAB_SIZE
        for _ in range(steps)
    ]


def is_selected(name: str, module: nn.Module) -> bool:
    """Leaf modules, the root model, every transformer block and every attention module."""
    if name == "" or next(module.children(), None) is None:
        return True
    kind = type(module).__name__
    return kind.endswith("Block") or kind.endswith("Attention")


def run_transformer_tiny(
    output_dir: Path,
    *,
    steps: int = 12,
    batch_size: int = 16,
    seed: int = 0,
    sample_every: int = 3,
) -> TransformerResult:
    """Train for ``steps`` AdamW steps under the observer, writing artifacts to ``output_dir``."""
    model = build_model(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    selected = [name for name, module in model.named_modules() if is_selected(name, module)]
    inject_observer(
        model,
        output_dir=Path(output_dir),
        sampler=EveryNForwardsSampler(sample_every),
        selector=is_selected,
    )
    losses = []
    try:
        for input_ids in counting_batches(steps, batch_size, seed):
            optimizer.zero_grad()
            out = model(input_ids=input_ids, labels=input_ids)
            out.loss.backward()
            optimizer.step()
            losses.append(float(out.loss.detach()))
    finally:
        remove_observer(model)
    return TransformerResult(stats_dir=Path(output_dir), losses=losses, selected_layers=selected)
