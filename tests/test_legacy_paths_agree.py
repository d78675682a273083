"""ti-core and ti-io spell torchinstruments 0.8.0's tensor paths with ti_schema.legacy_paths.

The translation lives once, in ti-schema (its round trip is tested there,
packages/ti-schema/tests/test_legacy_paths.py); this checks that the two packages using it
(the LegacySink of ti-core, ``ti upgrade`` of ti-io) call that one module rather than a copy.
"""

from __future__ import annotations

import ti_core.legacy
import ti_core.legacy.sink
import ti_io.finish.upgrade
from ti_schema import legacy_paths


def test_ti_core_uses_the_one_translation() -> None:
    assert ti_core.legacy.legacy_path is legacy_paths.legacy_path
    assert ti_core.legacy.sink.legacy_path is legacy_paths.legacy_path


def test_ti_io_uses_the_one_translation() -> None:
    assert ti_io.finish.upgrade.modern_path is legacy_paths.modern_path
