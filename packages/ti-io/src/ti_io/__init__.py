"""ti-io: the artifacts of an observed run.

``DirectorySink`` writes live Parquet parts, ``history.parquet``, ``histograms.parquet``,
``result.json``, ``index.md`` and TensorBoard events; ``TensorBoardSink`` adds the histograms
to a caller-owned TensorBoard writer; ``scan_history``, ``read_events`` / ``scan_events`` (the
flight recorder's ``ti.events``) and ``consolidate`` read and finish runs;
``compare_runs`` / ``compare_series`` line matched runs up by sample id; ``upgrade`` converts a
run written by torchinstruments 0.8.0; ``validate_run`` finds damaged files (every Parquet file
carries page checksums, which every read verifies: :mod:`ti_io.integrity`).
``inject_observer(model, output_dir=...)`` finds ``DirectorySink`` through the ``ti.sinks``
entry point, so ti-core never imports this package.

The package has two sides: :mod:`ti_io.write` (what a training process runs: the sink, the
part writer, TensorBoard events) and :mod:`ti_io.read` / :mod:`ti_io.finish` (reading,
comparing and finalizing runs, with Polars); :mod:`ti_io.cli` is the ``ti`` command. Names are
imported on first use, so a process that only writes parts never loads Polars.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ti_io.config import HistoryConfig
    from ti_io.errors import (
        ArtifactWriteError,
        DamagedPartsError,
        FinalizationBusyError,
        FinalizationError,
        NothingToConsolidateError,
        ShrinkRefusedError,
    )
    from ti_io.finish.consolidate import Consolidated, consolidate
    from ti_io.finish.upgrade import Upgraded, UpgradedRun, UpgradeError, upgrade
    from ti_io.finish.validation import RunValidation, validate_run
    from ti_io.integrity import DamagedFileError
    from ti_io.progress import ProgressCallback
    from ti_io.read.compare import ComparedRun, compare_runs, compare_series, open_runs, unshared
    from ti_io.read.events import read_events, scan_events
    from ti_io.read.history import scan_history
    from ti_io.read.legacy_layout import LegacyRunError, legacy_reason
    from ti_io.storage import CredentialsInURIError, RunLocation, StorageError, resolve_location
    from ti_io.write.directory_sink import DirectorySink
    from ti_io.write.tags import histogram_tag
    from ti_io.write.tensorboard_sink import TensorBoardSink

_LAZY: dict[str, str] = {
    "ArtifactWriteError": "ti_io.errors",
    "ComparedRun": "ti_io.read.compare",
    "CredentialsInURIError": "ti_io.storage",
    "Consolidated": "ti_io.finish.consolidate",
    "DamagedFileError": "ti_io.integrity",
    "DamagedPartsError": "ti_io.errors",
    "DirectorySink": "ti_io.write.directory_sink",
    "FinalizationBusyError": "ti_io.errors",
    "FinalizationError": "ti_io.errors",
    "HistoryConfig": "ti_io.config",
    "LegacyRunError": "ti_io.read.legacy_layout",
    "NothingToConsolidateError": "ti_io.errors",
    "ProgressCallback": "ti_io.progress",
    "RunLocation": "ti_io.storage",
    "RunValidation": "ti_io.finish.validation",
    "ShrinkRefusedError": "ti_io.errors",
    "StorageError": "ti_io.storage",
    "TensorBoardSink": "ti_io.write.tensorboard_sink",
    "UpgradeError": "ti_io.finish.upgrade",
    "Upgraded": "ti_io.finish.upgrade",
    "UpgradedRun": "ti_io.finish.upgrade",
    "compare_runs": "ti_io.read.compare",
    "compare_series": "ti_io.read.compare",
    "consolidate": "ti_io.finish.consolidate",
    "histogram_tag": "ti_io.write.tags",
    "legacy_reason": "ti_io.read.legacy_layout",
    "open_runs": "ti_io.read.compare",
    "read_events": "ti_io.read.events",
    "resolve_location": "ti_io.storage",
    "scan_events": "ti_io.read.events",
    "scan_history": "ti_io.read.history",
    "unshared": "ti_io.read.compare",
    "upgrade": "ti_io.finish.upgrade",
    "validate_run": "ti_io.finish.validation",
}
"""Where each public name lives; :func:`__getattr__` imports the module on first use."""

__all__ = [
    "ArtifactWriteError",
    "ComparedRun",
    "Consolidated",
    "CredentialsInURIError",
    "DamagedFileError",
    "DamagedPartsError",
    "DirectorySink",
    "FinalizationBusyError",
    "FinalizationError",
    "HistoryConfig",
    "LegacyRunError",
    "NothingToConsolidateError",
    "ProgressCallback",
    "RunLocation",
    "RunValidation",
    "ShrinkRefusedError",
    "StorageError",
    "TensorBoardSink",
    "UpgradeError",
    "Upgraded",
    "UpgradedRun",
    "compare_runs",
    "compare_series",
    "consolidate",
    "histogram_tag",
    "legacy_reason",
    "open_runs",
    "read_events",
    "resolve_location",
    "scan_events",
    "scan_history",
    "unshared",
    "upgrade",
    "validate_run",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ti_io' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
