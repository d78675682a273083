"""What the hooks do while Dynamo traces them: plain Python that Dynamo inlines, no graph break.

A hook of :mod:`ti_core.capture.hooks` takes this path when ``is_compiling()`` (a constant to
Dynamo) is true. It reads the gate's :class:`~ti_core.compiled.operators.TraceFlags` at trace
time; Dynamo guards on the value, so the sampled and the unsampled forward are two cached graphs,
chosen by a guard and never recompiled once both exist. The unsampled variant contains nothing of
the observer: no operator, copy or kernel. The sampled variant gets one ``record_call`` per call
of a selected module and a gradient hook on each output tensor a gradient will reach.

Where the root hooks run: on an observed ``OptimizedModule`` they run eagerly around the compiled
frame. On a module compiled after it was observed (``torch.compile(model)`` of a module whose
``forward`` is user code, ``model.compile()``), ``Module._call_impl`` (which Dynamo skips) calls
each hook as a frame of its own; :func:`run_hooks_eagerly_as_frames` tells Dynamo to run those
frames, and everything they call, eagerly, so the decision is taken in Python before the
forward's frame starts, as in eager mode. Where Dynamo inlines the root's hooks into the graph
(``torch.compile`` of a root whose ``forward`` is PyTorch's own, such as ``nn.Sequential``), no
Python runs before the graph: the decision for forward k+1 is taken when forward k ends (the
``end`` / ``advance`` operators), the gate's ``COMPILED_AHEAD`` state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
from torch import Tensor, is_grad_enabled, nn

from ti_core import _torch
from ti_core.compiled.operators import (
    FLAGS,
    LEAF,
    PLAIN,
    WATCH,
    TraceFlags,
    advance,
    begin,
    check,
    check_grad,
    end,
    record_call,
    record_grad,
    record_start,
    target_of,
)
from ti_core.compiled.slots import all_finite, can_be_nonfinite, flag_into, real_view

NESTED: Final[int] = 3
"""A tensor that requires grad, output inside activation checkpointing (a higher-order region)
of a compiled graph: a coverage gap."""

_MAX_DEPTH: Final = 32
"""As :func:`ti_core.tensor_paths.tensor_leaves`: nesting deeper than this is not walked."""

# Traced code names what it uses directly (``Tensor``, ``is_grad_enabled``), never through the
# global ``torch``: the same object reached from two modules' globals makes Dynamo add an
# aliasing guard that runs in Python on every call.
is_compiling: Final[Callable[[], bool]] = torch.compiler.is_compiling


CUDA_GRAPHS_REFUSED: Final[str] = (
    "ti-core's capture in compiled graphs does not support CUDA graphs (torch.compile "
    "mode='reduce-overhead' or 'max-autotune', or torch._inductor.config.triton.cudagraphs): a "
    "CUDA-graph replay runs no Python, and inductor cannot yet tell ti-core's operators apart "
    "from kernels it may record, so rows would silently stop after the first replay. Compile "
    "with mode='default' or 'max-autotune-no-cudagraphs' (on CPU, mode='reduce-overhead' has "
    "no effect anyway), or remove the observer (docs/capture.md, 'torch.compile')"
)


def cuda_graphs_requested(config: Mapping[str, Any] | None) -> bool:
    """Whether inductor with this configuration records CUDA graphs (None: not inductor)."""
    return config is not None and bool(config.get("triton.cudagraphs"))


@_torch.assume_constant_result
def _enter_compiled(key: int, ahead: bool) -> bool:
    """Trace time only (Dynamo calls it and folds the result into the graph): refuse CUDA
    graphs; the first trace of a hook switches its gate to compiled capture."""
    if cuda_graphs_requested(_torch.compiler_config()):
        raise ValueError(CUDA_GRAPHS_REFUSED)
    target = target_of(key)
    if target is not None:
        target.enter_compiled_mode(ahead=ahead)
    return True


@_torch.assume_constant_result
def _site(key: int, paths: tuple[str, ...]) -> int:
    """Trace time only: the number under which ``paths`` travel to ``record_call``."""
    target = target_of(key)
    return -1 if target is None else target.intern_paths(paths)


@_torch.assume_constant_result
def _slot(key: int, layer: int, site: int, position: int, device: str, watched: bool) -> int:
    """Trace time only: the sentinel's slot for this call's tensor at ``position`` of
    ``site`` in the graph being traced (-1: none, the ``check`` operator takes it);
    ``watched``: the graph checks its gradient."""
    target = target_of(key)
    if target is None:
        return -1
    return target.sentinel_slot(layer, site, position, device, watched)


@_torch.assume_constant_result
def _gradient_slot(key: int, layer: int, site: int, position: int, device: str) -> int:
    """Trace time only: the sentinel's gradient slot for the gradient flowing into the tensor
    at ``position`` of ``site`` (-1: none, ``check_grad`` takes it)."""
    target = target_of(key)
    if target is None:
        return -1
    return target.sentinel_gradient_slot(layer, site, position, device)


@_torch.assume_constant_result
def _gradient_check(key: int, layer: int, site: int, position: int) -> int:
    """Trace time: the number under which the gradient check of the tensor at ``position``
    of ``site`` travels to ``check_grad`` (-1: no sentinel)."""
    target = target_of(key)
    return -1 if target is None else target.sentinel_gradient_check(layer, site, position)


@_torch.assume_constant_result
def _counter(key: int, device: str) -> bool:
    """Trace time only: whether a check without a slot can read the slots' counter on
    ``device`` (made there if there are none yet)."""
    target = target_of(key)
    return target is not None and target.sentinel_counter(device)


@_torch.assume_constant_result
def _nested() -> bool:
    """Trace time only: inside a higher-order region (activation checkpointing) of the graph,
    where a ticket cannot be saved for backward (AOT autograd cannot save an effectful
    operator's result there), so gradients are not captured."""
    return _torch.in_nested_region()


# ----------------------------------------------------------------------------- the output walk


def traced_leaves(output: object) -> list[tuple[str, Tensor]]:
    """``tensor_leaves`` for traced code (no identity set: Dynamo cannot trace one): the same
    paths in the same order, tested over a corpus of outputs."""
    found: list[tuple[str, Tensor]] = []
    _walk(output, "", found, 0)
    return found


def _walk(obj: object, path: str, out: list[tuple[str, Tensor]], depth: int) -> None:
    if isinstance(obj, Tensor):
        out.append((path, obj))
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, str | bytes | int | float | bool):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out, depth + 1)
    elif isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        fields: tuple[str, ...] = type(obj)._fields  # type: ignore[attr-defined]
        for name, v in zip(fields, obj, strict=False):
            _walk(v, f"{path}.{name}", out, depth + 1)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name, None), f"{path}.{f.name}", out, depth + 1)


# ----------------------------------------------------------------------------- traced capture


def _kind(tensor: Tensor, grad_enabled: bool) -> int:
    if not (grad_enabled and tensor.requires_grad):
        return PLAIN
    return LEAF if tensor.is_leaf else WATCH


def _reporter(ticket: Tensor, position: int) -> Callable[[Tensor], None]:
    """The gradient hook of the tensor at ``position`` of a call: hands the gradient, as the
    autograd engine accumulated it for that tensor (every use, as eager tensor hooks see it),
    to ``record_grad``; never changes it."""

    def report(grad: Tensor) -> None:
        record_grad(grad, ticket, position)

    return report


def _capture(key: int, flags: TraceFlags, layer: int, module: nn.Module, output: Any) -> None:
    """One call of a selected module in a sampled forward being traced: one ``record_call``
    (also for an output without tensors, which still counts as a call) and a gradient hook on
    each tensor a gradient will reach (Dynamo traces ``register_hook`` on an intermediate
    into the graph)."""
    leaves = traced_leaves(output)
    grad_enabled = is_grad_enabled()
    tensors = [t for _, t in leaves]
    kinds = [_kind(t, grad_enabled) for t in tensors]
    if WATCH in kinds and _nested():
        kinds = [NESTED if kind == WATCH else kind for kind in kinds]
    ticket = record_call(
        tensors,
        key,
        layer,
        _site(key, tuple(p for p, _ in leaves)),
        bool(module.training),
        grad_enabled,
        kinds,
    )
    tickets = flags.tickets
    if tickets is not None:  # the root hooks are traced in this graph: ``end`` waits for it
        tickets.append(ticket)
    for position, (tensor, kind) in enumerate(zip(tensors, kinds, strict=True)):
        if kind == WATCH:
            tensor.register_hook(_reporter(ticket, position))  # type: ignore[no-untyped-call]


def _capture_start(
    key: int,
    flags: TraceFlags,
    layer: int,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    """One call of a selected module starts in a sampled forward being traced: one
    ``record_start`` holding every call signal's tensors among its arguments (also for a call
    without any, which still counts as a call)."""
    paths: list[str] = []
    tensors: list[Tensor] = []
    signals: list[int] = []
    for k, signal in enumerate(flags.call_signals):
        for path, tensor in signal.source(args, kwargs, traced_leaves):
            paths.append(path)
            tensors.append(tensor)
            signals.append(k)
    ticket = record_start(
        tensors,
        key,
        layer,
        _site(key, tuple(paths)),
        bool(module.training),
        is_grad_enabled(),
        signals,
    )
    tickets = flags.tickets
    if tickets is not None:  # the root hooks are traced in this graph: ``end`` waits for it
        tickets.append(ticket)


def _grad_flagger(slots: Tensor, sequence: Tensor, slot: int) -> Callable[[Tensor], None]:
    """The sentinel's gradient hook for one output tensor in an inductor graph: its gradient
    checked into ``slot`` of the gradient slots by the backward graph itself (inductor's
    kernels write them without bumping their version counter, which autograd checks for the
    tensors a backward saved); never changes the gradient."""

    def report(grad: Tensor) -> None:
        flag_into(slots, sequence, slot, real_view(grad.detach()))

    return report


def _grad_checker(key: int, check: int) -> Callable[[Tensor], None]:
    """The sentinel's gradient hook for one output tensor: whether its gradient is finite,
    computed in the backward graph, to ``check_grad``; never changes the gradient."""

    def report(grad: Tensor) -> None:
        check_grad(all_finite(real_view(grad.detach())), key, check)

    return report


def _check(key: int, layer: int, output: Any) -> None:
    """The flight recorder's sentinel on one call, in every variant of the graph: each
    floating or complex tensor of the output is checked into a slot of its own by the graph itself
    (:mod:`ti_core.compiled.slots`), and the gradient of each one a gradient will reach by a
    hook: into a gradient slot under a verified inductor, else whether it is finite to
    ``check_grad``. Inside a higher-order region (activation checkpointing), where a graph
    cannot write its inputs, and for a tensor without a slot, whether each is finite goes to
    one ``check`` instead."""
    leaves = [(p, t) for p, t in traced_leaves(output) if can_be_nonfinite(t.dtype)]
    if not leaves:
        return
    site = _site(key, tuple(p for p, _ in leaves))
    nested = _nested()
    flags = FLAGS[key]
    watched = (
        []
        if not flags.gradient_checks or not is_grad_enabled() or nested
        else [p for p, (_, t) in enumerate(leaves) if t.requires_grad and not t.is_leaf]
    )
    slots = flags.slots
    unslotted: list[int] = []
    for position, (_, tensor) in enumerate(leaves):
        slot = -1
        if not nested and slots is not None:
            slot = _slot(key, layer, site, position, str(tensor.device), position in watched)
        if slot >= 0 and slots is not None and slots.slots is not None:
            assert slots.sequence is not None  # made with the slots
            flag_into(slots.slots, slots.sequence, slot, real_view(tensor.detach()))
        else:
            unslotted.append(position)
    if unslotted:
        values = [all_finite(real_view(leaves[position][1].detach())) for position in unslotted]
        paths = tuple(leaves[position][0] for position in unslotted)
        device = str(leaves[unslotted[0]][1].device)
        order = (
            [slots.sequence]
            if slots is not None and _counter(key, device) and slots.sequence is not None
            else []
        )
        check(values, key, layer, _site(key, paths), bool(watched), order)
    gradient_slots = flags.gradient_slots
    for position in watched:
        tensor = leaves[position][1]
        slot = -1
        if gradient_slots is not None:
            slot = _gradient_slot(key, layer, site, position, str(tensor.device))
        if slot >= 0 and gradient_slots is not None and gradient_slots.slots is not None:
            assert gradient_slots.sequence is not None  # made with the slots
            hook = _grad_flagger(gradient_slots.slots, gradient_slots.sequence, slot)
        else:
            number = _gradient_check(key, layer, site, position)
            if number < 0:
                continue
            hook = _grad_checker(key, number)
        tensor.register_hook(hook)  # type: ignore[no-untyped-call]


def call(key: int, layer: int, module: nn.Module, output: Any) -> None:
    """Traced forward hook of a selected module (also the traced path of a forward override)."""
    _enter_compiled(key, False)
    flags = FLAGS[key]
    if flags.sentinel:
        _check(key, layer, output)
    if flags.sampled:
        _capture(key, flags, layer, module, output)


def call_start(
    key: int, layer: int, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """Traced forward pre-hook of a selected module (also the traced start of an override),
    present only when a call signal is recorded."""
    _enter_compiled(key, False)
    flags = FLAGS[key]
    if flags.sampled and flags.call_signals:
        _capture_start(key, flags, layer, module, args, kwargs)


def root_enter(
    key: int, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """Traced root pre-hook: the root's hooks are inlined into this graph (decided ahead)."""
    _enter_compiled(key, True)
    flags = FLAGS[key]
    if flags.sampled:
        begin(key)
        # A list made in the trace: Dynamo neither guards on it nor keeps its tensors alive.
        flags.tickets = []
        if flags.root_layer is not None and flags.call_signals:
            _capture_start(key, flags, flags.root_layer, module, args, kwargs)


def root_exit(key: int, module: nn.Module, output: Any) -> None:
    """Traced root forward hook: capture the root's output when selected, end the forward."""
    flags = FLAGS[key]
    if flags.sentinel and flags.root_layer is not None:
        _check(key, flags.root_layer, output)
    slots = flags.slots
    current = (
        [slots.slots, slots.sequence]
        if flags.sentinel and slots is not None and slots.slots is not None
        else []
    )
    if not flags.sampled:
        advance(key, current)
        return
    if flags.root_layer is not None:
        _capture(key, flags, flags.root_layer, module, output)
    end(key, flags.tickets or [], current)
    flags.tickets = None


def run_hooks_eagerly_as_frames(*functions: Callable[..., Any]) -> bool:
    """Tell Dynamo to run each function's frame, and every frame it calls, eagerly when it meets
    them as frames of their own (hooks that ``Module._call_impl`` calls under
    ``torch.compile``); where Dynamo inlines them they are still traced. Returns False when
    this torch has no such setting (then such hooks are compiled as frames of their own, and the
    root's take the decide-ahead path)."""
    return all([_torch.skip_frames(function) for function in functions])


__all__ = [
    "CUDA_GRAPHS_REFUSED",
    "NESTED",
    "call",
    "call_start",
    "cuda_graphs_requested",
    "is_compiling",
    "root_enter",
    "root_exit",
    "run_hooks_eagerly_as_frames",
    "traced_leaves",
]
