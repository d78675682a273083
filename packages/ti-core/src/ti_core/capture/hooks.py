"""The hook objects torch calls, and the small protocol they call into.

Lifecycle (the gate, :mod:`ti_core.gate`, installs and removes them all): two permanent hooks on
the root module; per-module forward hooks (or, with ``capture_direct_forwards``, instance-level
``forward`` overrides) only while sampling. Gradient hooks (:mod:`ti_core.capture.gradients`)
live on the autograd graph and die with it.

Every hook object pickles and deep-copies to an inert no-op, so ``copy.deepcopy(model)`` and
``torch.save(model)`` give unobserved copies that still run; the first call of a copied hook
removes the inherited hooks of its kind (:func:`scrub_copied_hooks`).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Final, Protocol

import torch
from torch import nn


class CaptureTarget(Protocol):
    """What the forward hooks report to (the gate of one observer)."""

    def root_enter(self, caller: FrameType | None = None) -> None:
        """A root forward starts (``caller``: the frame running the root's hooks)."""
        ...

    def root_exit(self, module: nn.Module, output: Any) -> None:
        """A root forward ended (also when it raised)."""
        ...

    def capture(self, layer: int, module: nn.Module, output: Any) -> None:
        """A selected module (``layer``: its index among the selected) returned ``output``."""
        ...


_HOOK_DICTS: Final[tuple[str, ...]] = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_ID_SETS: Final[tuple[str, ...]] = (
    "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
)


def _inert(*args: object, **kwargs: object) -> None:
    """What a copied hook becomes: returns None, and on a module call removes its kind."""
    if args and isinstance(args[0], nn.Module):
        scrub_copied_hooks(args[0])


def _inert_factory() -> Callable[..., None]:
    return _inert


class PassthroughForward:
    """What a copied :class:`ForwardOverride` becomes: the class ``forward`` of its module."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


def _copied_forward(module: nn.Module, previous: Callable[..., Any] | None) -> Callable[..., Any]:
    return previous if previous is not None else PassthroughForward(module)


def scrub_copied_hooks(module: nn.Module) -> None:
    """Remove what a copy of an observed module inherited (inert hooks, passthrough forward)."""
    for dict_name in _HOOK_DICTS:
        hooks = module.__dict__.get(dict_name)
        if not hooks:
            continue
        for key in [k for k, v in hooks.items() if v is _inert]:
            del hooks[key]
            for set_name in _HOOK_ID_SETS:
                ids = module.__dict__.get(set_name)
                if isinstance(ids, dict):
                    ids.pop(key, None)
    if isinstance(module.__dict__.get("forward"), PassthroughForward):
        del module.__dict__["forward"]


class HookObject:
    """Base of every hook object: copies and pickles become :func:`_inert`."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_inert_factory, ())


def _root_enter(target: CaptureTarget) -> None:
    target.root_enter()


def _root_exit(target: CaptureTarget, module: nn.Module, output: Any) -> None:
    target.root_exit(module, output)


def _capture(target: CaptureTarget, layer: int, module: nn.Module, output: Any) -> None:
    target.capture(layer, module, output)


# Under torch.compile the hooks run eagerly (a graph break) instead of being traced; in eager
# mode the undecorated functions are called, so unsampled forwards pay no wrapper cost. The
# wrappers come from torch.compiler.disable, which imports torch._dynamo (seconds, ~80 MB):
# made on first use, so only programs that compile pay for it (and made now if they already
# did, so a traced hook never meets an unwrapped function).
_EAGER: dict[Callable[..., None], Callable[..., None]] = {}


def _eager(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` wrapped by ``torch.compiler.disable`` (one wrapper per function)."""
    wrapped = _EAGER.get(fn)
    if wrapped is None:
        wrapped = _EAGER[fn] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
    return wrapped


if "torch._dynamo" in sys.modules:
    for _fn in (_root_enter, _root_exit, _capture):
        _eager(_fn)


class RootPreHook(HookObject):
    """Forward pre-hook of the root (registered first, so it runs before the user's)."""

    __slots__ = ("target",)

    def __init__(self, target: CaptureTarget) -> None:
        self.target = target

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            _eager(_root_enter)(self.target)
        else:
            self.target.root_enter(sys._getframe(1))


class RootPostHook(HookObject):
    """Always-called forward hook of the root."""

    __slots__ = ("target",)

    def __init__(self, target: CaptureTarget) -> None:
        self.target = target

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            _eager(_root_exit)(self.target, module, output)
        else:
            self.target.root_exit(module, output)


class CallHook(HookObject):
    """Forward hook on a selected module, installed only while sampling."""

    __slots__ = ("layer", "target")

    def __init__(self, target: CaptureTarget, layer: int) -> None:
        self.target = target
        self.layer = layer

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            _eager(_capture)(self.target, self.layer, module, output)
        else:
            self.target.capture(self.layer, module, output)


class ForwardOverride(HookObject):
    """Instance-level ``forward`` that captures direct ``module.forward(...)`` calls too.

    It replaces the forward hook of its module (calls through ``__call__`` also reach it), so no
    call is counted twice. ``previous`` is the instance ``forward`` the user had set, if any.
    """

    __slots__ = ("__weakref__", "layer", "module_ref", "previous", "target")

    def __init__(
        self,
        target: CaptureTarget,
        layer: int,
        module: nn.Module,
        previous: Callable[..., Any] | None,
    ) -> None:
        self.target = target
        self.layer = layer
        self.module_ref = weakref.ref(module)
        self.previous = previous

    @property
    def __wrapped__(self) -> Callable[..., Any] | None:
        """What ``inspect.signature`` should see: the forward this override delegates to."""
        if self.previous is not None:
            return self.previous
        module = self.module_ref()
        return None if module is None else type(module).forward.__get__(module)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_copied_forward, (self.module_ref(), self.previous))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        if self.previous is not None:
            output = self.previous(*args, **kwargs)
        elif module is not None:
            output = type(module).forward(module, *args, **kwargs)
        else:  # pragma: no cover - the module owns this object through its __dict__
            raise ReferenceError("module of this forward override is gone")
        if module is not None:
            if torch.compiler.is_compiling():
                _eager(_capture)(self.target, self.layer, module, output)
            else:
                self.target.capture(self.layer, module, output)
        return output


def install_forward_override(
    target: CaptureTarget, layer: int, module: nn.Module
) -> Callable[[], None]:
    """Put a :class:`ForwardOverride` on ``module``; return the function that undoes it exactly."""
    had_instance = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    override = ForwardOverride(target, layer, module, previous)
    module.__dict__["forward"] = override
    module_ref = weakref.ref(module)

    def restore() -> None:
        target = module_ref()
        if target is None or target.__dict__.get("forward") is not override:
            return
        if had_instance:
            target.__dict__["forward"] = previous
        else:
            del target.__dict__["forward"]

    return restore


__all__ = [
    "CallHook",
    "CaptureTarget",
    "ForwardOverride",
    "HookObject",
    "RootPostHook",
    "RootPreHook",
    "install_forward_override",
    "scrub_copied_hooks",
]
