"""Every module hook and override of one observer, installed and removed in one place.

Ownership: the gate holds one :class:`HookInstallation` and calls it under its lock. It keeps
the function that removes each hook exactly (a handle's ``remove`` or an override's undo), so
removal can never miss one: the two permanent root hooks (plus the root's ``forward`` override
with ``capture_direct_forwards``), and per-module capture, installed only while samples are in
flight (and for good once compiled). Per-module capture is, on every selected module but the
root: a ``forward`` override with ``capture_direct_forwards``; else, eagerly, a
:class:`~ti_core.capture.hooks.CallOverride` wherever
:func:`~ti_core.capture.hooks.call_overridable` (torch keeps its fast call path) and a forward
hook elsewhere; in compiled graphs forward hooks, which Dynamo traces.

``DataParallel`` replicas copy each module's ``__dict__`` (where a ``CallOverride`` lives, so a
replica would run the original module) but share its hook dicts: once a replica is met,
:meth:`HookInstallation.stop_call_overrides` switches capture to forward hooks for good.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from torch import nn

from ti_core.capture.hooks import (
    CallHook,
    CallPreHook,
    CaptureTarget,
    RootPostHook,
    RootPreHook,
    call_overridable,
    install_call_override,
    install_forward_override,
    install_root_forward_override,
    remove_call_overrides,
)


class HookInstallation:
    """The root hooks and per-module capture of one observer, as their exact removers."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        root_layer: int | None,
        *,
        direct: bool,
        call_overrides: bool,
        starts: bool = False,
    ) -> None:
        self._modules = [weakref.ref(m) for m in modules]
        self._starts = starts
        """Whether a call signal is recorded: per-module capture also hands over each call's
        arguments as it starts (a pre-hook beside each forward hook; the starting variant of
        each override)."""
        self._root_layer = root_layer
        self._direct = direct
        self._call_overrides = call_overrides
        """Whether eager capture may use a ``CallOverride`` (not inside ``DataParallel``)."""
        self._root_removers: list[Callable[[], None]] = []
        self._capture_removers: list[Callable[[], None]] = []
        self.overrides = False
        """Whether any installed per-module capture is a ``CallOverride``."""

    @property
    def capturing(self) -> bool:
        """Whether per-module capture is installed."""
        return bool(self._capture_removers)

    def install_root(self, target: CaptureTarget, root: nn.Module, *, compiled: bool) -> None:
        """The two permanent root hooks; with ``capture_direct_forwards`` (not on a compiled
        root), the root's ``forward`` override, so a direct ``model.forward(x)`` is a root
        forward."""
        self._root_removers = [
            root.register_forward_pre_hook(
                RootPreHook(target), prepend=True, with_kwargs=True
            ).remove,
            root.register_forward_hook(RootPostHook(target), always_call=True).remove,
        ]
        if self._direct and not compiled:
            self._root_removers.append(install_root_forward_override(target, root))

    def remove_root(self) -> None:
        removers, self._root_removers = self._root_removers, []
        for remove in removers:
            remove()

    def install_capture(self, target: CaptureTarget, *, compiled: bool = False) -> None:
        """Per-module capture on every selected module but the root (all or nothing)."""
        overrides = self._call_overrides and not compiled and not self._direct
        try:
            for layer, ref in enumerate(self._modules):
                module = ref()
                if module is None or layer == self._root_layer:
                    continue
                starts = self._starts
                if self._direct:
                    remove = install_forward_override(target, layer, module, starts=starts)
                    self._capture_removers.append(remove)
                elif overrides and call_overridable(module):
                    remove = install_call_override(target, layer, module, starts=starts)
                    self._capture_removers.append(remove)
                    self.overrides = True
                else:
                    if starts:
                        pre = CallPreHook(target, layer)
                        handle = module.register_forward_pre_hook(
                            pre, prepend=True, with_kwargs=True
                        )
                        self._capture_removers.append(handle.remove)
                    handle = module.register_forward_hook(CallHook(target, layer))
                    self._capture_removers.append(handle.remove)
        except BaseException:
            self.remove_capture()
            raise

    def remove_capture(self) -> None:
        removers, self._capture_removers = self._capture_removers, []
        self.overrides = False
        for remove in reversed(removers):
            remove()

    def stop_call_overrides(self, root: nn.Module) -> bool:
        """A ``DataParallel`` replica of ``root`` starts a forward: remove every replica's copy
        of a ``CallOverride`` and use forward hooks from now on. True when installed capture
        holds call overrides, which the caller must then reinstall."""
        remove_call_overrides(root)  # every replica's own copies, whichever comes first
        self._call_overrides = False
        return self.overrides


__all__ = ["HookInstallation"]
