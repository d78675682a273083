"""The public entry points: attach and remove an observer (:mod:`~ti_core.api.observe`), and
observe one pipeline stage inside its schedule's microbatches (:mod:`~ti_core.api.pipeline`).

The top floor of ti-core: it resolves what the user asked for and hands the observer
(:mod:`ti_core.observer`) its parts; nothing below imports it.
"""

from __future__ import annotations

from ti_core.api.observe import (
    attach,
    has_observer,
    inject_observer,
    observe,
    observer_of,
    remove_observer,
    trigger_capture,
)
from ti_core.api.pipeline import inject_stage_observer, remove_stage_observer

__all__ = [
    "attach",
    "has_observer",
    "inject_observer",
    "inject_stage_observer",
    "observe",
    "observer_of",
    "remove_observer",
    "remove_stage_observer",
    "trigger_capture",
]
