"""torch's global optimizer step hooks of one observer (the ``parameter_update`` signal).

Ownership: the gate holds one :class:`OptimizerHooks` and closes it at removal; the update
tracker (:mod:`ti_core.capture.updates`) asks it to install the hooks when an update window
opens and to remove them at the first root forward after the last window closed. The hooks are
process wide (every optimizer runs them), so they are installed only while a window waits, under
their own lock, and never removed from inside one (torch is iterating them then).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ti_core.capture.updates import OptimizerHook


class OptimizerHooks:
    """The two global optimizer step hooks, as the functions that remove them exactly (an
    :class:`~ti_core.capture.updates.OptimizerHookHost`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._removers: list[Callable[[], None]] = []
        self._closed = False

    def install_optimizer_hooks(self, pre: OptimizerHook, post: OptimizerHook) -> None:
        """Register ``pre`` / ``post`` as torch's global optimizer step pre- and post-hooks
        (every optimizer of the process runs them); a no-op when installed or closed."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        with self._lock:
            if self._removers or self._closed:
                return
            self._removers = [
                register_optimizer_step_pre_hook(pre).remove,
                register_optimizer_step_post_hook(post).remove,
            ]

    def remove_optimizer_hooks(self) -> None:
        """Remove the hooks (never from inside one: torch is iterating them then)."""
        with self._lock:
            removers, self._removers = self._removers, []
        for remove in removers:
            remove()

    def close(self) -> None:
        """Remove the hooks for good: nothing installs them again."""
        with self._lock:
            self._closed = True
        self.remove_optimizer_hooks()


__all__ = ["OptimizerHooks"]
