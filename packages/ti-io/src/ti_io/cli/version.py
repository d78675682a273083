"""``ti --version``: the data contract's version and each installed ti distribution's."""

from __future__ import annotations

from importlib import metadata
from typing import Final

from ti_schema import SCHEMA_VERSION

TI_DISTRIBUTIONS: Final[tuple[str, ...]] = (
    "ti-schema",
    "ti-core",
    "ti-io",
    "ti-dist",
    "ti-trainers",
    "ti-examples",
)
"""The TorchInstruments distributions ``ti --version`` reports when installed."""


def versions() -> str:
    """The data contract's version, then each installed ti distribution's, one per line."""
    lines = [f"data contract {SCHEMA_VERSION}"]
    for name in TI_DISTRIBUTIONS:
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "\n".join(lines)
