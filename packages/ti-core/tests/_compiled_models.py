"""The compiled-capture test models: a small MLP and a tiny pre-norm transformer block.

Tiny on purpose: every inductor compile of them is a real C++ build on 2 shared cores.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812  (the usual alias)


class MLP(nn.Module):
    """``depth`` blocks of Linear + in-place ReLU, then a Linear head (2 * depth + 1 leaves).

    The in-place ReLU matters: it rewrites its input, the Linear's captured output, in place,
    and inductor reuses that buffer without bumping the tensor's version.
    """

    def __init__(self, width: int = 32, depth: int = 4, out: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True)) for _ in range(depth)]
        )
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class SelfAttention(nn.Module):
    """Multi-head causal self-attention returning ``(output, None)``, like
    ``nn.MultiheadAttention`` with ``need_weights=False`` (a tuple with a non-tensor leaf)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d)), None


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))[0]
        return x + self.mlp(self.ln2(x))


def build(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """A seeded model and its input shape."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), (8, 32)
    if name == "block":
        return Block(), (2, 8, 32)
    raise ValueError(f"unknown model {name!r}; use 'mlp' or 'block'")
