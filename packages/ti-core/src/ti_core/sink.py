"""The contract between capture and storage, defined in ti-schema and re-exported here.

``Sink``, ``RunInfo``, ``LayerInfo``, ``SinkCapabilities`` and ``RunCost`` live in
:mod:`ti_schema.sink` so that sinks and readers (ti-io, third-party sinks) implement them
without torch; these are the same objects, so ``ti_core.Sink`` and ``ti_schema.Sink`` are
interchangeable.
"""

from __future__ import annotations

from ti_schema.cost import RunCost
from ti_schema.sink import (
    Barrier,
    DeclaresCapabilities,
    LayerInfo,
    RunInfo,
    Sink,
    SinkCapabilities,
    sink_capabilities,
)

__all__ = [
    "Barrier",
    "DeclaresCapabilities",
    "LayerInfo",
    "RunCost",
    "RunInfo",
    "Sink",
    "SinkCapabilities",
    "sink_capabilities",
]
