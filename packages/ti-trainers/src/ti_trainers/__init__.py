"""ti-trainers: TorchInstruments as a callback of the trainers people use.

- :class:`LightningObserverCallback` (``ti_trainers.lightning``; extra ``lightning``): attach
  at ``Trainer.fit`` start, remove at its end or on an exception.
- :class:`HFObserverCallback` (``ti_trainers.huggingface``; extra ``transformers``): attach at
  ``Trainer.train`` begin, remove at its end.

Both take the keyword arguments of ``ti_core.inject_observer`` and decide the rank from the
trainer (:class:`TrainerRanks`); ``loss_trigger=`` asks for a dense capture when the logged
training loss is non-finite or spikes (:class:`LossSpike`). Importing this package loads
neither Lightning nor transformers: each callback's module is imported when the name is first
used, and says which extra to install when its library is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ti_trainers.attachment import NothingObservedWarning, TrainerRanks
from ti_trainers.loss_spike import LossSpike

if TYPE_CHECKING:
    from ti_trainers.huggingface import HFObserverCallback
    from ti_trainers.lightning import LightningObserverCallback

_LAZY = {
    "HFObserverCallback": "ti_trainers.huggingface",
    "LightningObserverCallback": "ti_trainers.lightning",
}

__all__ = [
    "HFObserverCallback",
    "LightningObserverCallback",
    "LossSpike",
    "NothingObservedWarning",
    "TrainerRanks",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ti_trainers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
