"""torchinstruments 0.8.0's tensor paths, both directions from one grammar, and back again."""

from __future__ import annotations

import pytest

from ti_schema.legacy_paths import Step, legacy_path, legacy_step, modern_path, steps

# (today, gradient, 0.8.0): the shapes ti-core's LegacySink and ti-io's upgrade tests use
BOTH_WAYS = [
    ("", False, "output"),
    ("", True, "grad_output"),
    ("[0]", False, "output.0"),
    ("[-1]", False, "output.-1"),
    ("['aux'][0]", False, "output.aux.0"),
    ("['aux'][0]", True, "grad_output.aux.0"),
    ("['aux'][1]", True, "grad_output.aux.1"),
    ("['main']", False, "output.main"),
    ("['logits']", False, "output.logits"),
    ("[0][1][2]", False, "output.0.1.2"),
    ("['a']['b'][3]['c']", True, "grad_output.a.b.3.c"),
]
"""Paths that survive the round trip: indices and string keys without dots."""

TO_LEGACY = [
    *BOTH_WAYS,
    ('["a]b"]', False, "output.a]b"),  # a quoted key may hold a bracket
    ('["it\'s"]', False, "output.it's"),
    ("['a.b']", False, "output.a.b"),  # a dot in a key: 0.8.0 wrote two segments
    ("['0']", False, "output.0"),  # a string key that looks like an index
    ("[(1, 2)]", False, "output.(1, 2)"),  # another key: its text
    ("[None][1.5]", False, "output.None.1.5"),
    (".logits", False, "output.logits"),
    ("[1]['h'].state", False, "output.1.h.state"),
    (".hidden[0]", True, "grad_output.hidden.0"),
    ("weight", False, "output.weight"),  # not an accessor suffix: appended as it is
    ("[0]@S(0)", False, "output.[0]@S(0)"),
    ("['open", False, "output.['open"),
    ("[0", False, "output.[0"),
    ("..x", False, "output...x"),
    ("['a'b']", False, "output.['a'b']"),
]

TO_MODERN = [
    *((old, new) for new, _, old in BOTH_WAYS),
    ("output.logits", "['logits']"),  # a field comes back as a key (0.8.0 did not say)
    ("output.1.h.state", "[1]['h']['state']"),
    ("output.a]b", "['a]b']"),
    ("output.it's", '["it\'s"]'),
    ("output.007", "[7]"),
    ("output.", "['']"),
    ("output..x", "['']['x']"),
    ("output.(1, 2)", "['(1, 2)']"),
    ("something", "something"),  # under neither root: unchanged
    ("outputs.0", "outputs.0"),
    ("grad_outputx", "grad_outputx"),
    ("", ""),
]


@pytest.mark.parametrize(("path", "gradient", "old"), TO_LEGACY)
def test_todays_paths_in_0_8_0_spelling(path: str, gradient: bool, old: str) -> None:
    assert legacy_path(path, gradient=gradient) == old


@pytest.mark.parametrize(("old", "new"), TO_MODERN)
def test_0_8_0_paths_in_todays_spelling(old: str, new: str) -> None:
    assert modern_path(old) == new


@pytest.mark.parametrize(("path", "gradient", "old"), BOTH_WAYS)
def test_round_trip(path: str, gradient: bool, old: str) -> None:
    assert modern_path(legacy_path(path, gradient=gradient)) == path
    assert legacy_path(modern_path(old), gradient=gradient) == old


@pytest.mark.parametrize(("path", "gradient", "_"), TO_LEGACY)
def test_what_0_8_0_could_not_tell_apart_is_stable_after_one_trip(
    path: str, gradient: bool, _: str
) -> None:
    """Whatever 0.8.0 spelled ambiguously settles on one reading: a second trip changes
    nothing."""
    once = modern_path(legacy_path(path, gradient=gradient))
    assert modern_path(legacy_path(once, gradient=gradient)) == once


def test_one_grammar_both_ways() -> None:
    """Each direction's step is the other's: a parsed step's segment reads back as that step
    when it is an index or a dot-free string key."""
    parsed = steps("[1]['h'].state[(1, 2)]")
    assert parsed == (
        Step("[1]", "1"),
        Step("['h']", "h"),
        Step(".state", "state"),
        Step("[(1, 2)]", "(1, 2)"),
    )
    assert [legacy_step(s.segment) for s in parsed[:2]] == list(parsed[:2])
    assert steps("") == ()
    assert steps("weight") is None
