"""ti-core and ti-io spell torchinstruments 0.8.0's tensor paths as ti_schema.legacy_paths does.

The translation lives once, in ti-schema; this checks that the two packages using it (the
LegacySink of ti-core, ``ti upgrade`` of ti-io) give its answers on every shape of path,
generated from the grammar and at random.
"""

from __future__ import annotations

import random

from ti_core.legacy import legacy_path as core_legacy_path
from ti_io.finish.upgrade import modern_path as io_modern_path
from ti_schema.legacy_paths import legacy_path, modern_path

_KEYS: list[object] = ["aux", "a.b", "a]b", "it's", 'say "hi"', "0", "", "\\", 3, -1, (1, 2), None]


def _corpus() -> list[str]:
    """Today's paths of up to three steps (each kind of key, index and field) and random text."""
    rng = random.Random(26)
    step_spellings = [f"[{k!r}]" for k in _KEYS] + ["[0]", "[12]", ".state", ".h"]
    paths = ["", *step_spellings]
    paths += [a + b for a in step_spellings for b in step_spellings]
    paths += ["".join(rng.choices(step_spellings, k=3)) for _ in range(300)]
    alphabet = "ab.[]'\"\\0123-_ @S()"
    paths += ["".join(rng.choices(alphabet, k=rng.randint(1, 10))) for _ in range(2000)]
    paths += ["weight", "weight@S(0)", "[0]@S(0)"]
    return paths


CORPUS = _corpus()


def test_ti_core_spells_todays_paths_as_ti_schema() -> None:
    for path in CORPUS:
        for gradient in (False, True):
            assert core_legacy_path(path, gradient=gradient) == legacy_path(
                path, gradient=gradient
            ), path


def test_ti_io_reads_0_8_0_paths_as_ti_schema() -> None:
    olds = {legacy_path(p, gradient=g) for p in CORPUS for g in (False, True)}
    olds |= {*CORPUS, "output", "grad_output", "output.", "output.007", "outputs.0"}
    for old in sorted(olds):
        assert io_modern_path(old) == modern_path(old), old
