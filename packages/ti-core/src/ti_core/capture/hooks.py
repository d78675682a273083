"""The hook objects torch calls, and the small protocol they call into.

Lifecycle (the gate, :mod:`ti_core.gate`, installs and removes them all): two permanent hooks on
the root module; per-module capture only while sampling: instance-level ``_call_impl`` overrides
(:class:`CallOverride`, eager, where possible), forward hooks (:class:`CallHook`, elsewhere and
in compiled graphs), or, with ``capture_direct_forwards``, instance-level ``forward`` overrides
(and one on the root, permanent, so that a direct ``model.forward(x)`` is a root forward).
Gradient hooks (:mod:`ti_core.capture.gradients`) live on the autograd graph and die with it.

Every hook object pickles and deep-copies to an inert no-op, so ``copy.deepcopy(model)`` and
``torch.save(model)`` give unobserved copies that still run; the first call of a copied hook
removes the inherited hooks of its kind (:func:`scrub_copied_hooks`).

Under ``torch.compile`` each hook takes its traced path (:mod:`ti_core.compiled.traced`), which
Dynamo inlines into the graph without a break; met by Dynamo as frames of their own, the root and
call hooks run eagerly (``run_hooks_eagerly_as_frames`` below).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from torch import nn

from ti_core import _torch
from ti_core.compiled import traced
from ti_core.compiled.traced import is_compiling


class CaptureTarget(Protocol):
    """What the forward hooks report to (the gate of one observer)."""

    @property
    def trace_key(self) -> int:
        """The key under which traced hooks reach this target (:mod:`ti_core.compiled`)."""
        ...

    def root_enter(
        self,
        caller: FrameType | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        module: nn.Module | None = None,
    ) -> None:
        """A root forward starts (``caller``: the frame running the root's hooks; ``args``,
        ``kwargs``: its arguments; ``module``: the root)."""
        ...

    def root_exit(self, module: nn.Module, output: Any) -> None:
        """A root forward ended (also when it raised)."""
        ...

    def in_root_forward(self, caller: FrameType) -> bool:
        """Whether ``caller`` runs inside a root forward of this thread (a root forward's own
        ``forward`` call, or a nested one)."""
        ...

    def replica_entered(self, root: nn.Module) -> None:
        """A ``DataParallel`` replica of the root starts a forward (before :meth:`root_enter`)."""
        ...

    def capture(self, layer: int, module: nn.Module, output: Any) -> None:
        """A selected module (``layer``: its index among the selected) returned ``output``."""
        ...

    def capture_start(
        self, layer: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A call of a selected module starts with ``args`` and ``kwargs`` (installed only
        when a call signal such as ``input`` is recorded)."""
        ...

    def abandon_start(self, layer: int) -> None:
        """The call of ``layer`` that :meth:`capture_start` saw last raised (no output)."""
        ...


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
    for dict_name in _torch.HOOK_DICTS:
        hooks = module.__dict__.get(dict_name)
        if not hooks:
            continue
        for key in [k for k, v in hooks.items() if v is _inert]:
            del hooks[key]
            for set_name in _torch.HOOK_ID_SETS:
                ids = module.__dict__.get(set_name)
                if isinstance(ids, dict):
                    ids.pop(key, None)
    if isinstance(module.__dict__.get("forward"), PassthroughForward):
        del module.__dict__["forward"]
    if isinstance(module.__dict__.get(_torch.CALL_IMPL_ATTRIBUTE), PassthroughCall):
        del module.__dict__[_torch.CALL_IMPL_ATTRIBUTE]


class HookObject:
    """Base of every hook object: copies and pickles become :func:`_inert`."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_inert_factory, ())


class RootPreHook(HookObject):
    """Forward pre-hook of the root (registered first, so it runs before the user's; with the
    keyword arguments, which the flight recorder keeps for a replay)."""

    __slots__ = ("key", "target")

    def __init__(self, target: CaptureTarget) -> None:
        self.target = target
        self.key = target.trace_key

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if is_compiling():
            traced.root_enter(self.key, module, args, kwargs)
        else:
            if module.__dict__.get("_is_replica"):  # a DataParallel replica of the root
                self.target.replica_entered(module)
            self.target.root_enter(sys._getframe(1), args, kwargs, module)


class RootPostHook(HookObject):
    """Always-called forward hook of the root."""

    __slots__ = ("key", "target")

    def __init__(self, target: CaptureTarget) -> None:
        self.target = target
        self.key = target.trace_key

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if is_compiling():
            traced.root_exit(self.key, module, output)
        else:
            self.target.root_exit(module, output)


class CallHook(HookObject):
    """Forward hook on a selected module, installed while sampling (for good once compiled)."""

    __slots__ = ("key", "layer", "target")

    def __init__(self, target: CaptureTarget, layer: int) -> None:
        self.target = target
        self.key = target.trace_key
        self.layer = layer

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if is_compiling():
            traced.call(self.key, self.layer, module, output)
        else:
            self.target.capture(self.layer, module, output)


class CallPreHook(HookObject):
    """Forward pre-hook (with the keyword arguments) of a selected module, installed beside its
    :class:`CallHook` when a call signal is recorded: the call's arguments as it starts."""

    __slots__ = ("key", "layer", "target")

    def __init__(self, target: CaptureTarget, layer: int) -> None:
        self.target = target
        self.key = target.trace_key
        self.layer = layer

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if is_compiling():
            traced.call_start(self.key, self.layer, module, args, kwargs)
        else:
            self.target.capture_start(self.layer, module, args, kwargs)


class InstanceForward(HookObject):
    """Base of the instance-level ``forward`` overrides: the module (weakly), the instance
    ``forward`` the user had set (``previous``), what they delegate to, how copies behave."""

    __slots__ = ("__weakref__", "module_ref", "previous", "target")

    def __init__(
        self, target: CaptureTarget, module: nn.Module, previous: Callable[..., Any] | None
    ) -> None:
        self.target = target
        self.module_ref = weakref.ref(module)
        self.previous = previous

    def delegate(self) -> Callable[..., Any] | None:
        """The forward this override runs: ``previous``, else the class ``forward`` bound."""
        if self.previous is not None:
            return self.previous
        module = self.module_ref()
        return None if module is None else type(module).forward.__get__(module)

    @property
    def __wrapped__(self) -> Callable[..., Any] | None:
        """What ``inspect.signature`` should see: the forward this override delegates to."""
        return self.delegate()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_copied_forward, (self.module_ref(), self.previous))


class ForwardOverride(InstanceForward):
    """Instance-level ``forward`` that captures direct ``module.forward(...)`` calls too.

    It replaces the forward hook of its module (calls through ``__call__`` also reach it), so no
    call is counted twice. ``previous`` is the instance ``forward`` the user had set, if any.
    """

    __slots__ = ("key", "layer", "starts")

    def __init__(
        self,
        target: CaptureTarget,
        layer: int,
        module: nn.Module,
        previous: Callable[..., Any] | None,
        *,
        starts: bool = False,
    ) -> None:
        super().__init__(target, module, previous)
        self.key = target.trace_key
        self.layer = layer
        self.starts = starts
        """Whether a call signal is recorded: the arguments are handed over first."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        starts = False
        if self.starts and module is not None:
            if is_compiling():  # an exception aborts the graph, and the sample with it
                traced.call_start(self.key, self.layer, module, args, kwargs)
            else:
                self.target.capture_start(self.layer, module, args, kwargs)
                starts = True
        try:
            if self.previous is not None:
                output = self.previous(*args, **kwargs)
            elif module is not None:
                output = type(module).forward(module, *args, **kwargs)
            else:  # pragma: no cover - the module owns this object through its __dict__
                raise ReferenceError("module of this forward override is gone")
        except BaseException:
            if starts:
                self.target.abandon_start(self.layer)
            raise
        if module is not None:
            if is_compiling():
                traced.call(self.key, self.layer, module, output)
            else:
                self.target.capture(self.layer, module, output)
        return output


class RootForwardOverride(InstanceForward):
    """Instance-level ``forward`` of the root, with ``capture_direct_forwards``: a direct
    ``model.forward(x)`` is a root forward (sampled, counted and ended as one); inside a root
    forward (``model(x)``, whose root hooks already run, or a nested call) it only delegates,
    so nothing is counted twice."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        forward = self.delegate()
        if module is None or forward is None:  # pragma: no cover - the module owns this object
            raise ReferenceError("module of this forward override is gone")
        if is_compiling():
            return forward(*args, **kwargs)
        caller = sys._getframe(1)
        target = self.target
        if target.in_root_forward(caller):
            return forward(*args, **kwargs)
        target.root_enter(caller, args, kwargs, module)
        try:
            output = forward(*args, **kwargs)
        except BaseException:
            target.root_exit(module, None)
            raise
        target.root_exit(module, output)
        return output


class CallOverride(HookObject):
    """Instance-level ``_call_impl`` of a selected module: captures each call through
    ``module(...)`` once torch's own ``_call_impl`` (with the module's hooks) has returned.

    What the gate installs by default in eager mode (:func:`call_overridable`): a forward hook
    makes torch leave its fast call path for the slow one, which costs about as much again as
    the capture itself on models of many small modules (docs/capture.md, "How a call is
    captured"); this keeps the fast path. Torch's ``Module.__call__`` finds it as
    ``self._call_impl``; a direct ``module.forward(...)`` call does not, so it is not captured,
    as with a hook. The output captured is the one
    ``module(...)`` returns, after every forward hook of the module.
    """

    __slots__ = ("__weakref__", "key", "layer", "module_ref", "target")

    def __init__(self, target: CaptureTarget, layer: int, module: nn.Module) -> None:
        self.target = target
        self.key = target.trace_key
        self.layer = layer
        self.module_ref = weakref.ref(module)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (PassthroughCall, (self.module_ref(),))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        if module is None:  # pragma: no cover - the module owns this object through its __dict__
            raise ReferenceError("module of this call override is gone")
        output = _torch.MODULE_CALL_IMPL(module, *args, **kwargs)
        if is_compiling():  # traced by Dynamo when an eager sample left it installed
            traced.call(self.key, self.layer, module, output)
        else:
            self.target.capture(self.layer, module, output)
        return output


class StartingCallOverride(CallOverride):
    """A :class:`CallOverride` that also hands the call's arguments over as it starts (what
    the gate installs when a call signal such as ``input`` is recorded): the arguments given
    to ``module(...)``, before the module's own pre-hooks and forward run."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        if module is None:  # pragma: no cover - the module owns this object through its __dict__
            raise ReferenceError("module of this call override is gone")
        if is_compiling():
            traced.call_start(self.key, self.layer, module, args, kwargs)
            return super().__call__(*args, **kwargs)
        self.target.capture_start(self.layer, module, args, kwargs)
        try:
            return super().__call__(*args, **kwargs)
        except BaseException:
            self.target.abandon_start(self.layer)
            raise


class PassthroughCall:
    """What a copied :class:`CallOverride` becomes: torch's ``_call_impl`` of its module, which
    removes itself from the module at its first call."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (PassthroughCall, (self.module,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        scrub_copied_hooks(self.module)
        return _torch.MODULE_CALL_IMPL(self.module, *args, **kwargs)


def call_overridable(module: nn.Module) -> bool:
    """Whether a :class:`CallOverride` can capture ``module``'s calls: torch's own
    ``__call__``/``_call_impl`` (not overridden by its class or instance, not scripted) and no
    ``module.compile()`` of its own."""
    return _torch.default_call_path(module)


def install_call_override(
    target: CaptureTarget, layer: int, module: nn.Module, *, starts: bool = False
) -> Callable[[], None]:
    """Put a :class:`CallOverride` on ``module`` (a :class:`StartingCallOverride` with
    ``starts``); return the function that removes it."""
    override = (StartingCallOverride if starts else CallOverride)(target, layer, module)
    module.__dict__[_torch.CALL_IMPL_ATTRIBUTE] = override
    module_ref = weakref.ref(module)

    def remove() -> None:
        owner = module_ref()
        if owner is not None and owner.__dict__.get(_torch.CALL_IMPL_ATTRIBUTE) is override:
            del owner.__dict__[_torch.CALL_IMPL_ATTRIBUTE]

    return remove


def remove_call_overrides(root: nn.Module) -> None:
    """Remove every :class:`CallOverride` from the ``__dict__`` of ``root``'s modules (a
    ``DataParallel`` replica's copies, which would run the original modules)."""
    for module in root.modules():
        if isinstance(module.__dict__.get(_torch.CALL_IMPL_ATTRIBUTE), CallOverride):
            del module.__dict__[_torch.CALL_IMPL_ATTRIBUTE]


def install_forward_override(
    target: CaptureTarget, layer: int, module: nn.Module, *, starts: bool = False
) -> Callable[[], None]:
    """Put a :class:`ForwardOverride` on ``module``; return the function that undoes it exactly."""
    previous = module.__dict__.get("forward")
    return _set_forward(module, ForwardOverride(target, layer, module, previous, starts=starts))


def install_root_forward_override(target: CaptureTarget, root: nn.Module) -> Callable[[], None]:
    """Put a :class:`RootForwardOverride` on ``root``; return the function that undoes it
    exactly."""
    return _set_forward(root, RootForwardOverride(target, root, root.__dict__.get("forward")))


def _set_forward(module: nn.Module, override: InstanceForward) -> Callable[[], None]:
    had_instance = "forward" in module.__dict__
    previous = override.previous
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


# Met as frames of their own (called by the eager Module._call_impl under torch.compile), these
# run eagerly, as without compile. A forward override is not listed: its frame runs the module's
# forward, which Dynamo must compile.
traced.run_hooks_eagerly_as_frames(
    RootPreHook.__call__, RootPostHook.__call__, CallHook.__call__, CallPreHook.__call__
)


__all__ = [
    "CallHook",
    "CallOverride",
    "CallPreHook",
    "CaptureTarget",
    "ForwardOverride",
    "HookObject",
    "InstanceForward",
    "PassthroughCall",
    "RootForwardOverride",
    "RootPostHook",
    "RootPreHook",
    "StartingCallOverride",
    "call_overridable",
    "install_call_override",
    "install_forward_override",
    "install_root_forward_override",
    "remove_call_overrides",
    "scrub_copied_hooks",
]
