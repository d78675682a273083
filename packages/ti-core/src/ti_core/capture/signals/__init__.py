"""The call signals ti-core records: one module each in this package, found at import.

A module here that defines ``SIGNAL``, a :class:`~ti_core.call_signals.CallSignal` whose name
ti-schema declares, adds that signal to ``inject_observer(signals=...)``'s choices with
nothing else changed in ti-core (docs/architecture.md, "Where to change what"). The order is
the declaration's.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Collection, Iterable
from typing import Final

from ti_core.call_signals import CallSignal
from ti_schema import SIGNALS


def discover(package: str, paths: Iterable[str]) -> dict[str, CallSignal]:
    """The ``SIGNAL`` of every module of ``package`` (found under ``paths``), by name, in the
    order ti-schema declares them. ValueError for a module without one, an undeclared name, or
    two modules declaring one signal."""
    found: dict[str, CallSignal] = {}
    for info in sorted(pkgutil.iter_modules(list(paths)), key=lambda i: i.name):
        module = importlib.import_module(f"{package}.{info.name}")
        signal = getattr(module, "SIGNAL", None)
        if not isinstance(signal, CallSignal):
            raise ValueError(
                f"{module.__name__} defines no SIGNAL = CallSignal(...): every module of "
                f"{package} is a call signal"
            )
        if signal.name not in SIGNALS:
            raise ValueError(
                f"{module.__name__} declares the signal {signal.name!r}, which ti-schema does "
                f"not (declared: {list(SIGNALS)}); declare it in ti_schema.SIGNAL_DECLARATION"
            )
        if signal.name in found:
            raise ValueError(f"two modules of {package} declare the signal {signal.name!r}")
        found[signal.name] = signal
    return {name: found[name] for name in SIGNALS if name in found}


CALL_SIGNALS: Final[dict[str, CallSignal]] = discover(__name__, __path__)
"""Every call signal of ti-core, by name, in declaration order."""


def call_signals(names: Collection[str]) -> tuple[CallSignal, ...]:
    """The call signals among ``names`` (a run's ``signals=``), in declaration order."""
    return tuple(signal for name, signal in CALL_SIGNALS.items() if name in names)


__all__ = ["CALL_SIGNALS", "call_signals", "discover"]
