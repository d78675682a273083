"""The signals, declared once: each value of the ``signal`` column and what readers know of it.

Every producer and reader derives what it needs from :data:`SIGNAL_DECLARATION`: the schemas'
doc of the ``signal`` column, the validators' allowed values per contract version, result.json's
JSON Schema, ti-core's default ``signals=``, ti-io's and ti-dist's order of signals. A new signal
is one :class:`SignalSpec` here (and its name in :data:`Signal`, which static typing needs
spelled out; the two are checked equal at import), then its capture in ti-core
(docs/architecture.md, "Where to change what").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final, Literal, cast, get_args

Signal = Literal[
    "output",
    "output_gradient",
    "parameter",
    "parameter_gradient",
    "parameter_update",
    "optimizer_state",
    "attention",
    "input",
]
"""A value of the ``signal`` column (the names of :data:`SIGNAL_DECLARATION`, in its order)."""


@dataclass(frozen=True)
class SignalSpec:
    """One signal: the value of the ``signal`` column and what readers need to know of it."""

    name: str
    """The value of the ``signal`` column."""
    definition: str
    """One line, for docs and index.md."""
    added_in_minor: int
    """Minor contract version (of major 1) that introduced it: data of an older minor never
    holds it."""
    default: bool = False
    """Recorded unless the producer is asked for other signals (ti-core's
    ``inject_observer(signals=)``)."""
    parameter: bool = False
    """About a module's directly owned parameters: ``tensor_path`` is the parameter's name in
    the module (e.g. ``weight``), ``call_index`` is 0."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"SignalSpec(name=...) must be a non-empty string, got {self.name!r}")
        if isinstance(self.added_in_minor, bool) or not isinstance(self.added_in_minor, int):
            raise ValueError(f"SignalSpec {self.name!r}: added_in_minor must be an int")
        if self.added_in_minor < 0:
            raise ValueError(f"SignalSpec {self.name!r}: added_in_minor must be >= 0")


@dataclass(frozen=True)
class SignalDeclaration:
    """An ordered set of signals: the order readers list them in."""

    signals: tuple[SignalSpec, ...]

    def __post_init__(self) -> None:
        names = [s.name for s in self.signals]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"a signal declaration names {dupes} more than once")

    def __iter__(self) -> Iterator[SignalSpec]:
        return iter(self.signals)

    def __len__(self) -> int:
        return len(self.signals)

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self.signals)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.signals)

    def get(self, name: str) -> SignalSpec:
        """The signal named ``name``; KeyError naming the declared signals otherwise."""
        for s in self.signals:
            if s.name == name:
                return s
        raise KeyError(f"no signal {name!r} declared; the signals are {list(self.names)}")

    @property
    def defaults(self) -> tuple[str, ...]:
        """Names of the signals recorded by default."""
        return tuple(s.name for s in self.signals if s.default)

    @property
    def parameters(self) -> tuple[str, ...]:
        """Names of the signals about a module's own parameters."""
        return tuple(s.name for s in self.signals if s.parameter)

    @property
    def added_in(self) -> dict[str, int]:
        return {s.name: s.added_in_minor for s in self.signals}

    @property
    def definitions(self) -> dict[str, str]:
        return {s.name: s.definition for s in self.signals}

    def of_minor(self, minor: int) -> tuple[str, ...]:
        """Names of the signals that data of contract minor ``minor`` may hold."""
        return tuple(s.name for s in self.signals if s.added_in_minor <= minor)

    def extended(self, signals: Iterable[SignalSpec]) -> SignalDeclaration:
        """This declaration with ``signals`` appended (a copy; this one is unchanged)."""
        return SignalDeclaration((*self.signals, *signals))


SIGNAL_DECLARATION: Final[SignalDeclaration] = SignalDeclaration(
    (
        SignalSpec(
            "output",
            "a tensor in the output of a selected module's call",
            added_in_minor=0,
            default=True,
        ),
        SignalSpec(
            "output_gradient",
            "the gradient with respect to that output, from the first backward that reaches it",
            added_in_minor=0,
            default=True,
        ),
        SignalSpec(
            "parameter",
            "a parameter the module owns directly, as the sampled forward used it",
            added_in_minor=2,
            parameter=True,
        ),
        SignalSpec(
            "parameter_gradient",
            "that parameter's .grad at the end of the first backward that reaches the sampled "
            "forward (accumulated micro-batches included)",
            added_in_minor=2,
            parameter=True,
        ),
        SignalSpec(
            "parameter_update",
            "value after minus value before the first optimizer step that follows the sampled "
            "forward",
            added_in_minor=2,
            parameter=True,
        ),
        SignalSpec(
            "optimizer_state",
            "an Adam-type optimizer's state of a parameter the module owns directly, after the "
            "first optimizer step that follows the sampled forward: exp_avg, exp_avg_sq, and the "
            "squared gradient over the bias-corrected second moment (tensor_path "
            "weight.exp_avg, weight.exp_avg_sq, weight.grad_sq_over_v)",
            added_in_minor=5,
        ),
        SignalSpec(
            "attention",
            "the attention logits (q k^T times the scale, masked entries excluded) of each "
            "scaled_dot_product_attention call made inside a selected module's forward "
            "(tensor_path sdpa[k]: its k-th call in that module call)",
            added_in_minor=5,
        ),
        SignalSpec(
            "input",
            "a tensor among the positional and keyword arguments of a selected module's call, "
            "as the call starts (tensor_path [i] for the i-th positional argument, ['name'] for "
            "a keyword argument)",
            added_in_minor=5,
        ),
    )
)
"""Every signal of the contract, in the order readers list them: a module's output, the
gradient with respect to it, (contract 1.2) the module's own parameters, their gradients and
their updates, and (1.5) the optimizer's state of them, the attention logits and the module's
inputs (docs/data-contract.md)."""

if get_args(Signal) != SIGNAL_DECLARATION.names:  # pragma: no cover - a declaration mistake
    raise AssertionError(
        f"ti_schema.Signal {get_args(Signal)} and SIGNAL_DECLARATION "
        f"{SIGNAL_DECLARATION.names} must name the same signals in the same order"
    )

SIGNALS: Final[tuple[Signal, ...]] = cast("tuple[Signal, ...]", SIGNAL_DECLARATION.names)
"""Values of the ``signal`` column, in the order readers list them: a module's output, the
gradient with respect to it, and (contract 1.2) the module's own parameters, their gradients and
their updates."""

DEFAULT_SIGNALS: Final[tuple[Signal, ...]] = cast("tuple[Signal, ...]", SIGNAL_DECLARATION.defaults)
"""What a producer records unless asked for more (ti-core's ``inject_observer(signals=)``)."""

PARAMETER_SIGNALS: Final[tuple[Signal, ...]] = cast(
    "tuple[Signal, ...]", SIGNAL_DECLARATION.parameters
)
"""The opt-in signals about a module's directly owned parameters (``tensor_path`` = the
parameter's name in the module, e.g. ``weight``)."""

SIGNAL_ADDED_IN: Final[dict[Signal, int]] = cast("dict[Signal, int]", SIGNAL_DECLARATION.added_in)
"""Minor contract version (of major 1) that introduced each signal value."""

SIGNAL_DEFINITIONS: Final[dict[Signal, str]] = cast(
    "dict[Signal, str]", SIGNAL_DECLARATION.definitions
)
"""One-line definition of each signal, for docs and index.md."""

__all__ = [
    "DEFAULT_SIGNALS",
    "PARAMETER_SIGNALS",
    "SIGNALS",
    "SIGNAL_ADDED_IN",
    "SIGNAL_DECLARATION",
    "SIGNAL_DEFINITIONS",
    "Signal",
    "SignalDeclaration",
    "SignalSpec",
]
