"""What a signal entering through a selected module's call declares: where its tensors are.

A *call signal* is a plug-in (:mod:`ti_core.capture.signals`): its ti-schema declaration (a
``SignalSpec``: the value of the ``signal`` column) and one :class:`CallSignal`, which says
which tensors of a call's arguments it measures and under which ``tensor_path``. Everything
else is shared with the other signals: the gate's hooks hand the arguments over as the call
starts, before the module's forward runs (so an in-place forward cannot change what is
measured), eagerly and in compiled graphs; the sample snapshots the tensors into the signal's
own batch and hands it to emission when the root forward ends; the rows are measured by the
run's metrics, exactly, as an output's are.

It sits on the bottom floor, beside :mod:`ti_core.tensor_paths`, because both the capture side
(eager) and the compiled side (traced hooks, which read it from their trace flags) need it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ti_schema import Signal

Walk = Callable[[object], list[tuple[str, torch.Tensor]]]
"""Every tensor in an object with its ``tensor_path`` (``[i]`` for sequence items, ``['key']``
for mapping keys, ``.name`` for fields; :func:`ti_core.tensor_paths.tensor_leaves` eagerly,
:func:`ti_core.compiled.traced.traced_leaves` in traced code, which give the same paths)."""

Source = Callable[[tuple[Any, ...], Mapping[str, Any], Walk], list[tuple[str, torch.Tensor]]]
"""A call signal's tensors among one call's positional and keyword arguments, with their
paths, found with the ``walk`` it is given (plain Python: Dynamo traces it)."""


@dataclass(frozen=True, eq=False)
class CallSignal:
    """One signal whose tensors are among the arguments of a selected module's call."""

    name: Signal
    """The signal (a name of ``ti_schema.SIGNAL_DECLARATION``)."""
    source: Source
    """Where its tensors are in a call's ``(args, kwargs)``, with their ``tensor_path``."""


__all__ = ["CallSignal", "Source", "Walk"]
