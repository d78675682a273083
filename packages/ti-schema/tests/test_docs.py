"""docs/data-contract.md cannot drift from the schemas (skipped outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest

import ti_schema

DOC = Path(__file__).resolve().parents[3] / "docs" / "data-contract.md"


def _doc_text() -> str:
    if not DOC.is_file():
        pytest.skip(f"{DOC} is not here (installed-wheel test run)")
    return DOC.read_text(encoding="utf-8")


def _table(marker: str) -> list[list[str]]:
    match = re.search(rf"<!-- {re.escape(marker)} -->\n(.*?)<!-- end ", _doc_text(), re.DOTALL)
    assert match, f"marker <!-- {marker} --> missing from {DOC}"
    rows = [line for line in match.group(1).splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    return cells[2:]  # header and separator


def _render(typ: pa.DataType) -> str:
    if pa.types.is_list(typ):
        return f"list<{_render(typ.value_type)}>"
    return {"double": "float64"}.get(str(typ), str(typ))


def _expected(fields: list[pa.Field]) -> list[list[str]]:
    return [
        [
            f"`{f.name}`",
            f"`{_render(f.type)}`",
            "yes" if f.nullable else "no",
            f.metadata[b"doc"].decode(),
        ]
        for f in fields
    ]


def test_history_columns_table_matches_the_schema() -> None:
    assert _table("columns: ti.history") == _expected(list(ti_schema.history_schema()))


def test_histogram_columns_table_matches_the_schema() -> None:
    fields = [f for f in ti_schema.histogram_schema() if f.name not in ti_schema.IDENTITY_COLUMNS]
    assert _table("columns: ti.histograms") == _expected(fields)


def test_metrics_table_matches_the_definitions() -> None:
    expected = [[f"`{m}`", ti_schema.METRIC_DEFINITIONS[m]] for m in ti_schema.DEFAULT_METRICS]
    assert _table("metrics") == expected


def test_documented_version_and_kinds_are_current() -> None:
    text = _doc_text()
    assert f"(now `{ti_schema.SCHEMA_VERSION}`)" in text
    for kind in ti_schema.MISMATCH_KINDS:
        assert f"`{kind}`" in text


def test_signals_table_matches_the_definitions() -> None:
    expected = [[f"`{s}`", ti_schema.SIGNAL_DEFINITIONS[s]] for s in ti_schema.SIGNALS]
    assert _table("signals") == expected
    assert list(ti_schema.SIGNAL_DEFINITIONS) == list(ti_schema.SIGNALS)
