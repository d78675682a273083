"""The runtime protocol between a compiled graph and its observer: seven custom operators.

Compiled code runs Python only inside an operator the compiler treats as opaque; these operators
are that door. Each is a ``torch.library.custom_op`` in the ``ti`` namespace (but
``check_grad``, the one called per checked tensor in every compiled backward, defined with
``torch.library.Library`` for a cheaper call), declared *effectful* (``EffectType.ORDERED``):
without the declaration AOT autograd removes an operator whose result is unused as dead code;
with it, the operator stays in the graph, in program order, threaded by an effect token
(``test_torch_apis.py`` guards it). Each is tagged ``cudagraph_unsafe`` (a CUDA-graph
replay runs no Python), though inductor 2.13 does not see the tag through the effect wrapper,
which is why CUDA graphs are refused (:mod:`.traced`).

The operators carry an integer observer key and trace-time constants only (and, for ``advance``
and ``end``, the sentinel's slots as the graph holds them: :mod:`ti_core.compiled.slots`).
Traced code reaches an observer's state through :data:`FLAGS` by that key (one source per
object: Dynamo adds an aliasing guard, evaluated in Python on every call, when one object is
reached two ways), and the operators find the gate through a weak registry, so a graph that
outlives its observer runs them as no-ops.

Ownership of gradient state: ``record_call`` returns a *ticket*, a CPU int64 tensor whose Python
object carries the sample's gradient state (:data:`TICKET_STATE`). The gradient hooks that the
traced path registers on the call's output tensors hand it to ``record_grad``, so the compiled
graph saves it for backward: the state lives exactly as long as the autograd graph, as eager
tensor hooks do (PyTorch keeps a tensor's Python object, and its attributes, while the tensor
lives).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Protocol

import torch

from ti_core._torch import EffectType

if TYPE_CHECKING:
    from ti_core.call_signals import CallSignal
    from ti_core.compiled.slots import FlagSlots

NAMESPACE: Final[str] = "ti"
TICKET_STATE: Final[str] = "_ti_gradient_state"
"""Attribute of a ticket tensor: per tensor of the call it was made for, the gradient hook
(bound to the sample's gradient state) or None."""

# What record_call is told per captured tensor (decided at trace time).
PLAIN: Final[int] = 0
"""No gradient will flow back (grad disabled, no ``requires_grad``, integer dtype)."""
WATCH: Final[int] = 1
"""A gradient will flow back: the traced path hooks it (``record_grad``)."""
LEAF: Final[int] = 2
"""A leaf tensor that requires grad (an input or parameter returned unchanged): a coverage gap,
as in eager capture."""


class GradientReceiver(Protocol):
    """What a ticket carries per tensor: a gradient hook of one sample (``capture.GradHook``)."""

    def __call__(self, grad: torch.Tensor | None) -> None: ...


class CompiledTarget(Protocol):
    """What the operators and the trace-time calls report to (the gate of one observer)."""

    def enter_compiled_mode(self, *, ahead: bool) -> None:
        """Trace time: a hook of this observer is being traced (``ahead``: a root hook)."""
        ...

    def intern_paths(self, paths: tuple[str, ...]) -> int:
        """Trace time: the number under which an output's tensor paths travel."""
        ...

    def sentinel_slot(
        self, layer: int, site: int, position: int, device: str, watched: bool
    ) -> int:
        """Trace time: the sentinel's slot for one output tensor of a call in the graph being
        traced (-1: none); ``watched``: the graph checks its gradient."""
        ...

    def sentinel_gradient_slot(self, layer: int, site: int, position: int, device: str) -> int:
        """Trace time: the sentinel's gradient slot for the gradient flowing into one output
        tensor of a call in the graph being traced (-1: none, ``check_grad`` takes it)."""
        ...

    def sentinel_gradient_check(self, layer: int, site: int, position: int) -> int:
        """Trace time: the number under which the gradient check of one output tensor of a
        call travels to ``check_grad`` (-1: no sentinel)."""
        ...

    def sentinel_counter(self, device: str) -> bool:
        """Trace time: make the sentinel's slots (on ``device``) for a check without a slot to
        read their counter; False: none there."""
        ...

    def compiled_begin(self) -> None:
        """Run time: a sampled root forward whose root hooks were traced starts."""
        ...

    def compiled_end(self, slots: list[torch.Tensor]) -> None:
        """Run time: a sampled root forward whose root hooks were traced ends (``slots``: the
        sentinel's slots as the graph holds them, or empty)."""
        ...

    def compiled_advance(self, slots: list[torch.Tensor]) -> None:
        """Run time: an unsampled root forward whose root hooks were traced ends."""
        ...

    def compiled_check(
        self,
        values: list[torch.Tensor],
        layer: int,
        site: int,
        watched: bool,
        order: list[torch.Tensor],
    ) -> None:
        """Run time: whether each of one call's tensors is finite (a 0-d bool each);
        ``watched``: the graph checks the gradient of at least one of them; ``order``: the
        slots' counter at this call (one tensor), or empty."""
        ...

    def compiled_check_grad(self, finite: torch.Tensor, check: int) -> None:
        """Run time: whether the gradient flowing into one output tensor is finite (a 0-d
        bool; ``check``: its number from ``sentinel_gradient_check``)."""
        ...

    def compiled_record(
        self,
        tensors: list[torch.Tensor],
        layer: int,
        site: int,
        train: bool,
        grad_enabled: bool,
        kinds: list[int],
    ) -> Sequence[GradientReceiver | None] | None:
        """Run time: one call of a selected module in a sampled compiled forward; per tensor,
        what receives its gradient (None: nothing recorded)."""
        ...

    def compiled_record_start(
        self,
        tensors: list[torch.Tensor],
        layer: int,
        site: int,
        train: bool,
        grad_enabled: bool,
        signals: list[int],
    ) -> None:
        """Run time: one call of a selected module starts in a sampled compiled forward;
        ``signals``: per tensor, its call signal (an index into
        :attr:`TraceFlags.call_signals`)."""
        ...


class TraceFlags:
    """What traced code reads of one gate at trace time.

    Dynamo guards on every attribute read, so each value of :attr:`sampled` selects its own
    cached graph (no recompilation once both exist). Written by the gate only.
    """

    __slots__ = (
        "call_signals",
        "gradient_checks",
        "gradient_slots",
        "root_layer",
        "sampled",
        "sentinel",
        "slots",
        "tickets",
    )

    def __init__(self, root_layer: int | None) -> None:
        self.sampled = False
        """The root forward about to run (decided ahead: the next one) is sampled."""
        self.sentinel = False
        """The flight recorder's sentinel checks every forward (fixed at attach)."""
        self.gradient_checks = False
        """The sentinel checks gradients too (``"output_gradient"`` in its signals)."""
        self.slots: FlagSlots | None = None
        """The sentinel's output slots, which compiled graphs write (set with
        :attr:`sentinel`)."""
        self.gradient_slots: FlagSlots | None = None
        """The sentinel's gradient slots, which inductor's backward graphs write."""
        self.root_layer = root_layer
        """Index of the root among the selected modules, or None."""
        self.call_signals: tuple[CallSignal, ...] = ()
        """The call signals recorded (``input``; fixed at attach): the traced pre-hooks hand
        their tensors to ``record_call`` as each call starts."""
        self.tickets: list[torch.Tensor] | None = None
        """Trace time only: while a sampled root forward whose root hooks are traced is being
        traced, the tickets of its captures (``end`` takes them as inputs so it runs after
        every capture); None otherwise."""


FLAGS: dict[int, TraceFlags] = {}
"""Each registered gate's flags, by key: the one way traced code reaches them."""

_targets: dict[int, weakref.ref[CompiledTarget]] = {}
_keys = itertools.count(1)
_registry_lock = threading.Lock()


def register(target: CompiledTarget, root_layer: int | None) -> tuple[int, TraceFlags]:
    """A key and flags for ``target`` (held weakly): what its hooks and graphs will carry."""
    with _registry_lock:
        key = next(_keys)
        flags = TraceFlags(root_layer)
        FLAGS[key] = flags
        _targets[key] = weakref.ref(target)
    return key, flags


def unregister(key: int) -> None:
    """Forget ``key``'s target: graphs that still carry it run their operators as no-ops.

    The flags stay registered (reset to unsampled): a graph Dynamo keeps for this key guards on
    them, and a guard reading a missing key could fail on a path it does not expect.
    """
    with _registry_lock:
        _targets.pop(key, None)
        flags = FLAGS.get(key)
        if flags is not None:
            flags.sampled = False
            flags.tickets = None


def target_of(key: int) -> CompiledTarget | None:
    ref = _targets.get(key)
    return None if ref is None else ref()


_TAGS: Final = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op(f"{NAMESPACE}::begin", mutates_args=(), tags=_TAGS)
def begin(key: int) -> None:
    """Start of a sampled root forward whose root hooks were traced into the graph."""
    target = target_of(key)
    if target is not None:
        target.compiled_begin()


@begin.register_fake
def _begin_fake(key: int) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::record_call", mutates_args=(), tags=_TAGS)
def record_call(
    tensors: list[torch.Tensor],
    key: int,
    layer: int,
    site: int,
    train: bool,
    grad_enabled: bool,
    kinds: list[int],
) -> torch.Tensor:
    """One call of a selected module in a sampled compiled forward: record ``tensors``.

    ``site`` numbers the output's tensor paths (interned at trace time: an operator schema has
    no list-of-strings type); ``kinds`` says per tensor :data:`PLAIN`, :data:`WATCH` or
    :data:`LEAF`. Returns the ticket (one int64 per tensor).
    """
    ticket = torch.zeros(len(tensors), dtype=torch.int64)
    target = target_of(key)
    if target is not None:
        receivers = target.compiled_record(tensors, layer, site, train, grad_enabled, kinds)
        if receivers is not None and any(r is not None for r in receivers):
            setattr(ticket, TICKET_STATE, receivers)
    return ticket


@record_call.register_fake
def _record_call_fake(
    tensors: list[torch.Tensor],
    key: int,
    layer: int,
    site: int,
    train: bool,
    grad_enabled: bool,
    kinds: list[int],
) -> torch.Tensor:
    return torch.empty((len(tensors),), dtype=torch.int64, device="cpu")


@torch.library.custom_op(f"{NAMESPACE}::record_start", mutates_args=(), tags=_TAGS)
def record_start(
    tensors: list[torch.Tensor],
    key: int,
    layer: int,
    site: int,
    train: bool,
    grad_enabled: bool,
    signals: list[int],
) -> torch.Tensor:
    """One call of a selected module starts in a sampled compiled forward: record the call
    signals' ``tensors`` among its arguments (``signals``: per tensor, the index of its call
    signal in the flags' :attr:`TraceFlags.call_signals`; ``site`` numbers their paths).
    Returns a ticket, which ``end`` waits for when the root's hooks are traced."""
    target = target_of(key)
    if target is not None:
        target.compiled_record_start(tensors, layer, site, train, grad_enabled, signals)
    return torch.zeros(len(tensors), dtype=torch.int64)


@record_start.register_fake
def _record_start_fake(
    tensors: list[torch.Tensor],
    key: int,
    layer: int,
    site: int,
    train: bool,
    grad_enabled: bool,
    signals: list[int],
) -> torch.Tensor:
    return torch.empty((len(tensors),), dtype=torch.int64, device="cpu")


@torch.library.custom_op(f"{NAMESPACE}::record_grad", mutates_args=(), tags=_TAGS)
def record_grad(grad: torch.Tensor, ticket: torch.Tensor, position: int) -> None:
    """Gradient hook of a recorded output tensor: its gradient, as autograd accumulated it."""
    receivers = getattr(ticket, TICKET_STATE, None)
    if receivers is None:
        return
    receiver = receivers[position]
    if receiver is not None:
        # A fresh alias: compiled kernels write buffers without bumping ``_version``, so the
        # batch must not take this object for one it has measured already.
        receiver(grad.detach())


@record_grad.register_fake
def _record_grad_fake(grad: torch.Tensor, ticket: torch.Tensor, position: int) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::end", mutates_args=(), tags=_TAGS)
def end(key: int, after: list[torch.Tensor], slots: list[torch.Tensor]) -> None:
    """End of a sampled root forward with traced root hooks: emit it, decide the next one.

    ``after`` holds the tickets of every ``record_call`` of the forward: a data dependency,
    because inductor does not keep an argument-less effectful operator in program order (it
    ran ``end`` before captures it should follow, in a transformer block's graph). ``slots``:
    the sentinel's slots and counter as this graph has written them (it writes them back to
    the real tensors only when it returns), or empty.
    """
    target = target_of(key)
    if target is not None:
        target.compiled_end(slots)


@end.register_fake
def _end_fake(key: int, after: list[torch.Tensor], slots: list[torch.Tensor]) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::advance", mutates_args=(), tags=_TAGS)
def advance(key: int, slots: list[torch.Tensor]) -> None:
    """End of an unsampled root forward with traced root hooks: count it, decide the next
    (``slots``: as for ``end``)."""
    target = target_of(key)
    if target is not None:
        target.compiled_advance(slots)


@advance.register_fake
def _advance_fake(key: int, slots: list[torch.Tensor]) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::check", mutates_args=(), tags=_TAGS)
def check(
    values: list[torch.Tensor],
    key: int,
    layer: int,
    site: int,
    watched: bool,
    order: list[torch.Tensor],
) -> None:
    """The flight recorder's check of one call of a selected module without a slot (inside
    activation checkpointing, or past the slots' capacity): ``values`` holds, per checked
    tensor, a 0-d bool that is true when it is finite (computed in the graph, on the tensors'
    device), in the order of the paths interned as ``site``; ``watched``: a gradient check of
    the graph's backward waits on one of them (decided at trace time); ``order``: the slots'
    counter as the graph holds it here, so the check falls in place among the slots' flags
    (or empty)."""
    target = target_of(key)
    if target is not None:
        target.compiled_check(values, layer, site, watched, order)


@check.register_fake
def _check_fake(
    values: list[torch.Tensor],
    key: int,
    layer: int,
    site: int,
    watched: bool,
    order: list[torch.Tensor],
) -> None:
    return None


def _check_grad(finite: torch.Tensor, key: int, check: int) -> None:
    """The flight recorder's check of the gradient flowing into one checked output tensor:
    whether that gradient is finite (a 0-d bool computed in the backward graph; ``check``:
    which tensor, numbered at trace time)."""
    target = target_of(key)
    if target is not None:
        target.compiled_check_grad(finite, check)


# ``check_grad`` runs once per checked output per compiled backward, so it is defined with
# ``torch.library.Library`` rather than ``custom_op``: no Python autograd wrapper (its
# arguments never require grad; the C++ autograd fallback passes them through), about a
# quarter of ``custom_op``'s dispatch cost per call. Same effect and tag as the others.
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # type: ignore[no-untyped-call]
_LIBRARY.define(  # type: ignore[no-untyped-call]
    "check_grad(Tensor finite, int key, int check) -> ()",
    tags=_TAGS,
)
_LIBRARY.impl("check_grad", _check_grad, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
torch.library.register_fake(f"{NAMESPACE}::check_grad", lambda *args: None, lib=_LIBRARY)
_LIBRARY._register_effectful_op(f"{NAMESPACE}::check_grad", EffectType.ORDERED)
check_grad: Final = torch.ops.ti.check_grad.default

OPERATORS: Final = (begin, record_call, record_start, record_grad, end, advance, check)
"""The ``custom_op`` operators (``check_grad`` is defined with ``_LIBRARY``)."""
for _op in OPERATORS:
    _op.register_effect(EffectType.ORDERED)


__all__ = [
    "FLAGS",
    "LEAF",
    "NAMESPACE",
    "OPERATORS",
    "PLAIN",
    "TICKET_STATE",
    "WATCH",
    "CompiledTarget",
    "GradientReceiver",
    "TraceFlags",
    "advance",
    "begin",
    "check",
    "check_grad",
    "end",
    "record_call",
    "record_grad",
    "record_start",
    "register",
    "target_of",
    "unregister",
]
