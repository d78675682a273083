"""The precision metrics' declaration: names, formats, the reserved-name rule, the doc table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ti_schema import (
    DEFAULT_PROFILE,
    FULL_PRECISION_PROFILE,
    PRECISION_FORMATS,
    declared_metric,
    metric_name_problem,
    precision_profile,
    profile_of,
)
from ti_schema.precision import MIN_ABS_NONZERO, check_formats, format_specs

DOC = Path(__file__).resolve().parents[3] / "docs" / "data-contract.md"


def test_the_profile_appends_min_abs_nonzero_then_each_format() -> None:
    assert precision_profile(()) is DEFAULT_PROFILE
    profile = precision_profile(["float8_e4m3fn", "bfloat16", "float8_e4m3fn"])
    assert profile.names[: len(DEFAULT_PROFILE)] == DEFAULT_PROFILE.names
    assert profile.names[len(DEFAULT_PROFILE) :] == (
        "min_abs_nonzero",
        "underflow_fraction.float8_e4m3fn",
        "subnormal_fraction.float8_e4m3fn",
        "overflow_fraction.float8_e4m3fn",
        "underflow_fraction.bfloat16",
        "subnormal_fraction.bfloat16",
        "overflow_fraction.bfloat16",
    )
    for name in profile.names[len(DEFAULT_PROFILE) + 1 :]:
        spec = profile.get(name)
        assert spec.fraction
        assert spec.over == "all"
        assert spec.combine == "entry_mean"
    assert MIN_ABS_NONZERO.combine == "min"
    assert MIN_ABS_NONZERO.null_reason
    assert profile_of(["mean", "overflow_fraction.bfloat16", "abs_max"]).names == (
        *DEFAULT_PROFILE.names,
        "overflow_fraction.bfloat16",
    )
    assert len(FULL_PRECISION_PROFILE) == len(DEFAULT_PROFILE) + 1 + 3 * len(PRECISION_FORMATS)
    assert declared_metric("p50") == DEFAULT_PROFILE.get("p50")
    assert declared_metric("abs_max") is None


def test_unknown_formats_are_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"precision= names unknown format\(s\) \['fp8'\]"):
        check_formats(["bfloat16", "fp8"])
    with pytest.raises(TypeError, match="collection of format names"):
        check_formats("bfloat16")
    with pytest.raises(ValueError, match=r"'mxfp8_e4m3'"):
        precision_profile(["e4m3"])


def test_reserved_names() -> None:
    assert metric_name_problem("underflow_fraction.float8_e5m2") is None
    assert metric_name_problem("grad.norm") is None
    assert metric_name_problem("abs_max") is None
    assert "unknown format 'fp4'" in (metric_name_problem("underflow_fraction.fp4") or "")
    assert "not a precision metric" in (metric_name_problem("p50.bfloat16") or "")


def test_the_doc_table_is_the_declaration() -> None:
    if not DOC.is_file():
        pytest.skip(f"{DOC} is not here (installed-wheel test run)")
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"<!-- precision metrics -->\n(.*?)<!-- end ", text, re.DOTALL)
    assert match
    rows = [line for line in match.group(1).splitlines() if line.startswith("|")][2:]
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    expected = [[f"`{MIN_ABS_NONZERO.name}`", MIN_ABS_NONZERO.definition]]
    expected += [
        [f"`{s.name.replace('float16', 'F')}`", s.definition.replace("float16", "F")]
        for s in format_specs("float16")
    ]
    expected += [[f"`{s.name}`", s.definition] for s in format_specs("mxfp8_e4m3")]
    assert cells == expected
