"""Version of the data contract, independent of the package versions."""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final[str] = "1.5"
"""``major.minor`` of the ti contract. A minor bump only adds nullable columns, optional keys of
the ``ti`` metadata or values of the ``signal`` column (1.1 added ``window``, ``upgraded_from``
and ``unrecorded``; 1.2 the signals ``parameter``, ``parameter_gradient`` and
``parameter_update``; 1.3 the ``ti.events`` table, written by the flight recorder, and the
precision metrics ``min_abs_nonzero`` and ``<metric>.<format>``, :mod:`ti_schema.precision`;
1.4 the ``telemetry_cost`` run fact of the ``ti`` metadata, :mod:`ti_schema.cost`; 1.5 the
``ti.events`` columns ``replay`` and ``replay_reason``, the flight recorder's verdict)."""

SCHEMA_MAJOR: Final[int] = int(SCHEMA_VERSION.split(".")[0])
SCHEMA_MINOR: Final[int] = int(SCHEMA_VERSION.split(".")[1])
