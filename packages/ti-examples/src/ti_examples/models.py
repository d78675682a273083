"""Small PyTorch models for the debugging experiments, with readable layer names.

Every model keeps the same parameters across the baseline, broken and fixed variant of its
experiment (the fixes only add or swap parameter-free modules), so a fixed seed gives all three
runs identical initial weights.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``[norm] -> fc1 -> act -> fc2``: the two-layer regressor most experiments use.

    ``norm`` is an optional parameter-free input normalization; ``act`` is any activation module.
    """

    def __init__(
        self,
        in_features: int,
        hidden: int,
        act: nn.Module,
        *,
        norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if norm is not None:
            self.norm = norm
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = act
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "norm"):
            x = self.norm(x)
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class BatchStandardize(nn.Module):
    """Standardize each feature with the batch's own mean and std, dividing by ``max(std, eps)``.

    With ``eps=0`` a feature that is constant within a batch divides zero by zero: the fault the
    ``nonfinite`` experiment injects.
    """

    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=0, keepdim=True)
        std = x.std(dim=0, keepdim=True, unbiased=False)
        if self.eps > 0:
            std = std.clamp_min(self.eps)
        return (x - mean) / std

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


class StandardizedMLP(nn.Module):
    """``standardize -> fc1 -> act -> fc2`` with batch standardization of the raw inputs."""

    def __init__(self, in_features: int, hidden: int, *, eps: float) -> None:
        super().__init__()
        self.standardize = BatchStandardize(eps)
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(self.standardize(x))))
        return out


class FeatureBankNet(nn.Module):
    """A trunk and a head; once ``bank_enabled`` it keeps the latest trunk features.

    The bank is meant to hold a detached copy. ``detach_in_place=True`` reproduces the common bug
    of writing ``h = h.detach()`` instead: the head then trains on a tensor cut off from the
    trunk, so no gradient reaches the trunk layers again.
    """

    def __init__(self, in_features: int, hidden: int, *, detach_in_place: bool) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, 1)
        self.detach_in_place = detach_in_place
        self.bank_enabled = False
        self.bank: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        if self.bank_enabled:
            if self.detach_in_place:
                h = h.detach()
                self.bank = h
            else:
                self.bank = h.detach()
        out: torch.Tensor = self.head(h)
        return out


class HiddenNormMLP(nn.Module):
    """``fc1 -> act -> norm -> fc2``: the hidden features are layer-normalized (no affine).

    The normalized features have a fixed scale, so any growth of the output comes from ``fc2``'s
    weights alone.
    """

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.norm(self.act(self.fc1(x))))
        return out


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention``.

    ``qk_norm`` applies a parameter-free layer norm to each head's query and key before the
    attention (QK-layernorm, Wortsman et al. 2023): it bounds the attention logits and adds no
    parameters, so a seed gives the same weights with and without it.
    """

    def __init__(self, width: int, heads: int, *, qk_norm: bool = False) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.head_dim = width // heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)
        self.qk_norm = qk_norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = h.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        if self.qk_norm:
            q = nn.functional.layer_norm(q, (self.head_dim,))
            k = nn.functional.layer_norm(k, (self.head_dim,))
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        out: torch.Tensor = self.o(y.transpose(1, 2).reshape(batch, tokens, width))
        return out


class FeatureTransformer(nn.Module):
    """A regressor that reads each input feature as a token: feature ``i`` becomes
    ``x_i * embed[i] + position[i]``, a learned summary token is put first, one pre-norm block
    (attention without a residual around it, then a residual MLP), and a linear head on the
    summary token.

    Without the residual around the attention, the summary token sees the features only
    through the attention: when its softmax saturates on one token, the model loses the others.
    """

    def __init__(self, features: int, width: int = 32, heads: int = 2, *, qk_norm: bool) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(features, width))
        self.position = nn.Parameter(torch.randn(features, width) * 0.5)
        self.summary = nn.Parameter(torch.randn(1, 1, width) * 0.5)
        self.norm1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, qk_norm=qk_norm)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.norm_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unsqueeze(-1) * self.embed + self.position
        h = torch.cat([self.summary.expand(x.shape[0], 1, -1), h], dim=1)
        h = self.attn(self.norm1(h))
        h = h + self.fc2(nn.functional.gelu(self.fc1(self.norm2(h))))
        out: torch.Tensor = self.head(self.norm_out(h)[:, 0])
        return out
