"""The runs committed for ti-io's torch-free tests still look like what the writer produces.

packages/ti-io/tests/data/core-runs/ was written by ti-core and ti-io (make_runs.py next to it).
Here the same script writes a fresh set with the current code, and everything that defines the
data's shape must match: the files of each run (part names, rank directories), every Parquet
file's Arrow schema (field docs included) and `ti` footer, run.json's keys, result.json's
catalog and keys, index.md's headings. Values differ run to run (run ids, timestamps) and are
not compared. When this fails, run `python packages/ti-io/tests/data/make_runs.py`.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow.parquet as pq
import pytest

from ti_schema import parse_metadata

DATA_DIR = Path(__file__).resolve().parents[1] / "packages" / "ti-io" / "tests" / "data"
EVENTS = re.compile(r"events\.out\.tfevents\..+")


def _make_runs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ti_io_make_runs", DATA_DIR / "make_runs.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    destination = tmp_path_factory.mktemp("fresh") / "core-runs"
    _make_runs().write_runs(destination)
    return destination


def _files(root: Path) -> list[str]:
    """Every file under ``root``, relative, event files (named by time, host, pid) generalized."""
    names = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        name = "events.out.tfevents.*" if EVENTS.fullmatch(relative.name) else relative.name
        names.append(str(relative.with_name(name)))
    return names


def _footer(path: Path) -> dict[str, Any]:
    doc = dict(parse_metadata(pq.read_metadata(path).metadata))
    doc["producer"] = doc["producer"].split(" ")[0]  # the distribution, not its version
    if "telemetry_cost" in doc:  # measured in each run: its keys, not its values
        doc["telemetry_cost"] = sorted(doc["telemetry_cost"])
    return doc


def _keys(value: Any, path: str = "$") -> set[str]:
    """Every JSON path of object keys in ``value``, list positions generalized to [*]."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            found.add(f"{path}.{key}")
            found |= _keys(item, f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            found |= _keys(item, f"{path}[*]")
    return found


def test_the_committed_runs_have_the_files_the_writer_writes(fresh: Path) -> None:
    assert _files(DATA_DIR / "core-runs") == _files(fresh)


def test_the_committed_parquet_files_have_the_writers_schema_and_footer(fresh: Path) -> None:
    committed = sorted((DATA_DIR / "core-runs").rglob("*.parquet"))
    assert committed
    for path in committed:
        current = fresh / path.relative_to(DATA_DIR / "core-runs")
        old, new = pq.read_schema(path), pq.read_schema(current)
        # field docs compared here; the schema-level `ti` entry through the footer below
        assert old.remove_metadata().equals(new.remove_metadata(), check_metadata=True), path
        assert set(old.metadata or {}) == set(new.metadata or {}), path
        assert _footer(path) == _footer(current), path
        assert pq.read_metadata(path).num_rows == pq.read_metadata(current).num_rows, path


def test_the_committed_json_and_markdown_have_the_writers_keys(fresh: Path) -> None:
    for path in sorted((DATA_DIR / "core-runs").rglob("*.json")):
        current = fresh / path.relative_to(DATA_DIR / "core-runs")
        old, new = json.loads(path.read_text()), json.loads(current.read_text())
        assert _keys(old) == _keys(new), path
        if path.name == "result.json":
            assert [r["layer"] for r in old] == [r["layer"] for r in new], path
    for path in sorted((DATA_DIR / "core-runs").rglob("index.md")):
        current = fresh / path.relative_to(DATA_DIR / "core-runs")

        def headings(p: Path) -> list[str]:
            """The Markdown headings (lines in code blocks are code: comments, event times)."""
            found, fenced = [], False
            for line in p.read_text().splitlines():
                if line.startswith("```"):
                    fenced = not fenced
                elif line.startswith("#") and not fenced:
                    found.append(line)
            return found

        assert headings(path) == headings(current), path
