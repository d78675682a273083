"""Version of the data contract, independent of the package versions."""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final[str] = "1.1"
"""``major.minor`` of the ti contract. A minor bump only adds nullable columns or optional
keys of the ``ti`` metadata (1.1 added ``window``, ``upgraded_from`` and ``unrecorded``)."""

SCHEMA_MAJOR: Final[int] = int(SCHEMA_VERSION.split(".")[0])
SCHEMA_MINOR: Final[int] = int(SCHEMA_VERSION.split(".")[1])
