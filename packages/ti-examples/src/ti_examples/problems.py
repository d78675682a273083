"""The six debugging experiments: what breaks, how it is introduced, what fixes it.

Each :class:`Problem` describes three matched runs that share the seed, the batches and the
optimizer. ``baseline`` trains normally; ``broken`` introduces the fault at the onset step;
``fixed`` introduces the same fault into a run that carries a known intervention. The evidence
panels name the history series (layer, signal, metric) in which the fault is expected to show.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Final, Literal

import torch
from torch import nn

from ti_core.selection import Selector
from ti_examples.models import (
    MLP,
    FeatureBankNet,
    FeatureTransformer,
    HiddenNormMLP,
    StandardizedMLP,
)
from ti_schema import DEFAULT_SIGNALS, Signal

Variant = Literal["baseline", "broken", "fixed"]
VARIANTS: tuple[Variant, ...] = ("baseline", "broken", "fixed")

IN_FEATURES = 16
HIDDEN = 32


DERIVED_METRICS: Final[dict[str, str]] = {
    "l2_norm": "L2 norm over the finite entries, from mean, std and shape: "
    "sqrt(n * (std**2 + mean**2)), n = prod(shape) * (1 - nonfinite_fraction)",
    "update_to_weight": "l2_norm of the parameter_update over l2_norm of the parameter, "
    "at the same sample",
}
"""Series computed from recorded metrics (evidence.py), beside the metrics themselves."""

LOSS: Final[str] = "loss"
"""The ``signal`` of a panel that plots the training loop's loss at each sampled step (the
loss the loop computed, not a recorded tensor)."""


@dataclass(frozen=True)
class Panel:
    """One evidence series: a metric of one signal of one layer at call 0, for the tensor at
    ``tensor_path`` (``""``: the bare output; a parameter's name for the parameter signals).
    ``metric`` is a recorded metric or one of :data:`DERIVED_METRICS`."""

    layer: str
    signal: str
    metric: str
    log_scale: bool = False
    tensor_path: str = ""

    @property
    def label(self) -> str:
        """``"fc1 output_gradient std"``, ``"fc2.weight parameter l2_norm"``: the series name
        used in tables, CSV and plots."""
        where = f"{self.layer}.{self.tensor_path}" if self.tensor_path else self.layer
        return f"{where} {self.signal} {self.metric}"


class Problem(ABC):
    """A fault, the evidence expected to show it, and the intervention that fixes it."""

    name: ClassVar[str]
    fault: ClassVar[str]
    """What goes wrong at the onset step, in one sentence."""
    evidence: ClassVar[str]
    """Where the fault shows in the artifacts, in one sentence."""
    fix: ClassVar[str]
    """The intervention the fixed run carries, in one sentence."""
    panels: ClassVar[tuple[Panel, ...]]
    lr: ClassVar[float] = 0.05
    signals: ClassVar[tuple[Signal, ...]] = DEFAULT_SIGNALS
    """What the observer records (``inject_observer(signals=)``): the panels' signals."""
    min_steps: ClassVar[int] = 0
    """Training steps the fault needs to show (the run is at least this long)."""
    sentinel: ClassVar[bool] = False
    """Whether the broken run carries the flight recorder's sentinel (``inject_observer(
    sentinel=True)``): its event names the module and forward where the fault began, with the
    replay's verdict (real numerics, or a transient fault)."""

    @abstractmethod
    def build_model(self, variant: Variant) -> nn.Module:
        """The model for ``variant``; parameters must not depend on the variant."""

    def selector(self) -> Selector | None:
        """Which modules the observer selects (``inject_observer(selector=)``; None: the leaf
        modules)."""
        return None

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer every variant uses."""
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)

    def start_fault(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Introduce the fault; called once, before the onset step, in broken and fixed runs."""
        return None

    def inputs(self, x: torch.Tensor, *, faulty: bool) -> torch.Tensor:
        """The inputs the model sees; ``faulty`` is true from the onset step on."""
        return x

    def before_step(self, model: nn.Module, variant: Variant) -> None:
        """Runs between ``backward`` and ``optimizer.step`` (for example gradient clipping)."""
        return None


class InactiveRelu(Problem):
    name = "inactive_relu"
    fault = (
        "A corrupted update shifts the hidden bias far negative, so every pre-activation is "
        "below zero and the ReLU outputs only zeros."
    )
    evidence = (
        "The ReLU output's zero_fraction reaches 1 and stays there; the gradient reaching fc1 "
        "becomes all zeros, so the units cannot recover."
    )
    fix = "LeakyReLU(0.01) keeps a small slope below zero, so gradients still reach fc1."
    panels = (
        Panel("act", "output", "zero_fraction"),
        Panel("fc1", "output_gradient", "zero_fraction"),
    )

    def build_model(self, variant: Variant) -> nn.Module:
        act: nn.Module = nn.LeakyReLU(0.01) if variant == "fixed" else nn.ReLU()
        return MLP(IN_FEATURES, HIDDEN, act)

    def start_fault(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        assert isinstance(model, MLP)
        with torch.no_grad():
            model.fc1.bias.sub_(50.0)


class Saturation(Problem):
    name = "saturation"
    fault = (
        "The inputs arrive unnormalized (a preprocessing step is skipped: values x1000), pushing "
        "the pre-activations deep into the sigmoid's flat tails."
    )
    evidence = (
        "fc1's output std jumps by orders of magnitude and the gradient with respect to it "
        "(the gradient before the sigmoid) collapses."
    )
    fix = "A parameter-free LayerNorm normalizes each input vector before fc1."
    panels = (
        Panel("fc1", "output", "std", log_scale=True),
        Panel("fc1", "output_gradient", "std", log_scale=True),
    )
    input_scale: ClassVar[float] = 1000.0

    def build_model(self, variant: Variant) -> nn.Module:
        norm = nn.LayerNorm(IN_FEATURES, elementwise_affine=False) if variant == "fixed" else None
        return MLP(IN_FEATURES, HIDDEN, nn.Sigmoid(), norm=norm)

    def inputs(self, x: torch.Tensor, *, faulty: bool) -> torch.Tensor:
        return x * self.input_scale if faulty else x


class ScaleGrowth(Problem):
    name = "scale_growth"
    fault = (
        "A learning-rate schedule bug multiplies the learning rate by 18; every update "
        "overshoots, so fc2's weights, and with them the model output, grow step after step."
    )
    evidence = (
        "The model output's std (fc2) grows by orders of magnitude after the onset, and the "
        "gradient with respect to it grows with it. The parameters say why: fc2's weight norm "
        "grows with the output, and its update-to-weight ratio jumps at the onset (each step "
        "moves the weights by a far larger fraction of their size)."
    )
    fix = "Gradient-norm clipping (max_norm=0.1) bounds every update, so the scale stays put."
    panels = (
        Panel("fc2", "output", "std", log_scale=True),
        Panel("fc2", "output_gradient", "std", log_scale=True),
        Panel("fc2", "parameter", "l2_norm", log_scale=True, tensor_path="weight"),
        Panel("fc2", "parameter_update", "update_to_weight", log_scale=True, tensor_path="weight"),
    )
    signals = (*DEFAULT_SIGNALS, "parameter", "parameter_update")
    lr = 0.02
    lr_factor: ClassVar[float] = 18.0
    max_norm: ClassVar[float] = 0.1

    def build_model(self, variant: Variant) -> nn.Module:
        return HiddenNormMLP(IN_FEATURES, HIDDEN)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr)

    def start_fault(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * self.lr_factor

    def before_step(self, model: nn.Module, variant: Variant) -> None:
        if variant == "fixed":
            nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)


class Nonfinite(Problem):
    name = "nonfinite"
    fault = (
        "One input feature goes constant (a dead sensor reading 0), so batch standardization "
        "divides 0 by a zero std and NaN enters the network."
    )
    evidence = (
        "nonfinite_fraction appears in the standardization output, then fills fc1 and every "
        "layer once the NaN gradients reach the weights."
    )
    fix = "Clamp the standard deviation at eps=1e-5 before dividing."
    panels = (
        Panel("standardize", "output", "nonfinite_fraction"),
        Panel("fc2", "output", "nonfinite_fraction"),
    )
    sentinel = True

    def build_model(self, variant: Variant) -> nn.Module:
        return StandardizedMLP(IN_FEATURES, HIDDEN, eps=1e-5 if variant == "fixed" else 0.0)

    def inputs(self, x: torch.Tensor, *, faulty: bool) -> torch.Tensor:
        if not faulty:
            return x
        x = x.clone()
        x[:, 0] = 0.0
        return x


class Detached(Problem):
    name = "detached"
    fault = (
        "A feature bank switched on at the onset stores the trunk features with "
        "`h = h.detach()`, cutting the head's input off from the trunk."
    )
    evidence = (
        "The trunk layers' output_gradient rows stop after the onset (drawn as gaps), while the "
        "head's gradient rows continue."
    )
    fix = "Store `h.detach()` in the bank and keep training on `h`."
    panels = (
        Panel("trunk.0", "output_gradient", "std", log_scale=True),
        Panel("head", "output_gradient", "std", log_scale=True),
    )

    def build_model(self, variant: Variant) -> nn.Module:
        return FeatureBankNet(IN_FEATURES, HIDDEN, detach_in_place=variant != "fixed")

    def start_fault(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        assert isinstance(model, FeatureBankNet)
        model.bank_enabled = True


def _attention_modules(name: str, module: nn.Module) -> bool:
    """The leaf modules and the attention module (which owns the attention's projections)."""
    return name == "attn" or next(iter(module.children()), None) is None


class AttentionLogits(Problem):
    name = "attention_logits"
    fault = (
        "A learning-rate bug gives the attention's query and key projections 10x the learning "
        "rate of the rest of the model (a parameter group's schedule gone wrong), and the model "
        "has no QK-layernorm."
    )
    evidence = (
        "The largest attention logit (the attention signal's max) grows ten-fold within two "
        "samples of the onset and keeps growing while the softmax saturates (Wortsman et al. "
        "2023); the loss stays with the baseline's for several samples more, then falls behind "
        "it and stays there (the attention sees one token)."
    )
    fix = (
        "QK-layernorm: a parameter-free layer norm of each head's query and key before the "
        "attention bounds the logits at the same learning rates."
    )
    panels = (
        Panel("attn", "attention", "max", log_scale=True, tensor_path="sdpa[0]"),
        Panel("training loop", LOSS, "mse", log_scale=True),
    )
    signals = (*DEFAULT_SIGNALS, "attention")
    lr = 0.01
    lr_factor: ClassVar[float] = 10.0
    max_norm: ClassVar[float] = 1.0
    min_steps = 100

    def build_model(self, variant: Variant) -> nn.Module:
        return FeatureTransformer(IN_FEATURES, qk_norm=variant == "fixed")

    def selector(self) -> Selector | None:
        return _attention_modules

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        qk = [p for n, p in model.named_parameters() if n.startswith(("attn.q.", "attn.k."))]
        rest = [p for n, p in model.named_parameters() if not n.startswith(("attn.q.", "attn.k."))]
        groups = [{"params": qk, "name": "qk"}, {"params": rest, "name": "rest"}]
        return torch.optim.AdamW(groups, lr=self.lr, weight_decay=0.0)

    def start_fault(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            if group["name"] == "qk":
                group["lr"] = group["lr"] * self.lr_factor

    def before_step(self, model: nn.Module, variant: Variant) -> None:
        # every variant clips: what breaks the broken run is the logits, not a raw blow-up
        nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)


PROBLEMS: dict[str, Problem] = {
    p.name: p
    for p in (
        InactiveRelu(),
        Saturation(),
        ScaleGrowth(),
        Nonfinite(),
        Detached(),
        AttentionLogits(),
    )
}
"""Every experiment by name, in the order the main job runs them."""
