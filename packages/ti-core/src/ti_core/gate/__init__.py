"""The sampling gate: which root forwards are captured, and the owner of every hook.

:mod:`~ti_core.gate.gate` holds :class:`Gate` and its states (:class:`GateState`);
:mod:`~ti_core.gate.compiled` its side of the compiled graphs' protocol;
:mod:`~ti_core.gate.hook_installation` and :mod:`~ti_core.gate.optimizer_hooks` the hooks it
installs and removes; :mod:`~ti_core.gate.root_nesting` each thread's root calls. The gate
stands above capture and the flight recorder, whose objects it drives, and below the observer
that owns it.
"""

from __future__ import annotations

from ti_core.gate.gate import Gate, GateState, SampleOwner

__all__ = ["Gate", "GateState", "SampleOwner"]
