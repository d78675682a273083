"""What a replay restores around the step it re-runs, and what it needs to know of the ranks.

The replay (:class:`~ti_core.sentinel.replay.Replayer`) runs the eager module (compiled code
eagerly), with the step's RNG states and autocast, and leaves the module's buffers and plain
attributes as it found them; a DDP root in a group of ranks reduces its gradients across them
(:func:`reduced_across_ranks`), and a forward that gathers sharded parameters cannot be replayed
on one rank (:func:`collectives_in_forward`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

import torch
from torch import nn

from ti_core import _torch


@contextlib.contextmanager
def eager_stance() -> Iterator[None]:
    """Compiled code (``torch.compile``, ``module.compile()``) runs eagerly for the replay:
    nothing is compiled, no cached graph is touched."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # pragma: no cover - torch < 2.6
        yield
        return
    with set_stance("force_eager"):
        yield


@contextlib.contextmanager
def rng_of(cpu_rng: torch.Tensor, cuda_rng: tuple[tuple[int, torch.Tensor], ...]) -> Iterator[None]:
    """A step's RNG states (the CPU's, each CUDA device's) for the replay; the current ones
    again after it."""
    cpu = torch.get_rng_state()
    cuda = [(d, torch.cuda.get_rng_state(d)) for d, _ in cuda_rng]
    torch.set_rng_state(cpu_rng)
    for device, state in cuda_rng:
        torch.cuda.set_rng_state(state, device)
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for device, state in cuda:
            torch.cuda.set_rng_state(state, device)


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Every buffer of ``module`` as it was before the replay, after it (in place, through
    ``.data``: its version counter does not move, so an autograd graph of the step that saved
    it, BatchNorm's running statistics, still runs its backward)."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.data.copy_(value)


_PLAIN: Final = (int, float, bool, str, type(None))


@contextlib.contextmanager
def attributes_kept(module: nn.Module) -> Iterator[None]:
    """The plain attributes (numbers, strings, None) of every submodule as they were before
    the replay, after it: a call counter or a step number the forward advances is not moved by
    the replay (other Python state its forward changes, a list it appends to, is)."""
    saved = [
        (m.__dict__, {k: v for k, v in m.__dict__.items() if type(v) in _PLAIN})
        for m in module.modules()
    ]
    try:
        yield
    finally:
        for attributes, values in saved:
            for key, value in values.items():
                if attributes.get(key, value) is not value:
                    attributes[key] = value


@contextlib.contextmanager
def autocast(states: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, dtype in states:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def world_size() -> int:
    """Ranks of the default process group (1 when there is none)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return 1


def reduced_across_ranks(root: nn.Module) -> bool:
    """Whether ``root``'s parameter gradients are known to be reduced across ranks in its
    backward: a ``DistributedDataParallel`` wrapper (under ``torch.compile``'s or not) in a
    process group of more than one rank."""
    if world_size() < 2:
        return False
    from torch.nn.parallel import DistributedDataParallel

    module: nn.Module | None = root
    while module is not None:
        if isinstance(module, DistributedDataParallel):
            return True
        module = _torch.compiled_inner(module)
    return False


def collectives_in_forward(eager: nn.Module) -> str | None:
    """Why re-running ``eager``'s forward on one rank would run collectives the other ranks
    do not (FSDP's all-gathers, tensor-parallel ``DTensor`` parameters); None when it would
    not."""
    for module in eager.modules():
        kind = type(module)
        if any(
            base.__name__.startswith(("FSDP", "FullyShardedDataParallel")) for base in kind.__mro__
        ):
            return (
                f"{kind.__name__} gathers its parameters across ranks in every forward: a "
                "replay on this rank alone would wait for the others"
            )
    for name, parameter in eager.named_parameters():
        if type(parameter).__name__ == "DTensor" or type(parameter.data).__name__ == "DTensor":
            return (
                f"the parameter {name} is a DTensor (sharded across ranks): a replay on this "
                "rank alone would run collectives the others do not"
            )
    return None


__all__ = [
    "attributes_kept",
    "autocast",
    "buffers_kept",
    "collectives_in_forward",
    "eager_stance",
    "reduced_across_ranks",
    "rng_of",
    "world_size",
]
