"""The reducer types users configure ``inject_observer(reducers=...)`` with.

A stable import location (``from ti_core.reducers import DefaultProfile``); the engine behind
them is the :mod:`ti_core.reduction` subpackage.
"""

from __future__ import annotations

from ti_core.reduction.plan import DefaultProfile, Reducer, ReducerSpec, default_reducers

__all__ = ["DefaultProfile", "Reducer", "ReducerSpec", "default_reducers"]
