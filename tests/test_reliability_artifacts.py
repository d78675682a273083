"""Safe artifacts: module names are arbitrary strings (``nn.ModuleDict`` keys may hold ``/``,
newlines, Markdown and HTML); they never become paths, never break result.json, index.md or
TensorBoard tags, never escape the output directory; artifacts are read without pickle or code
execution."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from urllib.parse import unquote

import polars as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import ti_io
import ti_schema
from ti_core import AlwaysSampler, inject_observer, remove_observer
from ti_io import scan_history
from ti_schema.result_json import validate_result_json
from ti_schema.testing import load_strict_json

NASTY = (
    "/etc/passwd",
    "a/b\\c",
    "line\n```\n# heading\n```python\nimport os",
    "<script>alert('x')</script><img src=x onerror=alert(1)>",
    "| col | `tick` *em* [link](javascript:alert(1)) &amp;",
    "tab\there \u202e rtl \x00 nul",
    "%root",
)


class Nasty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict()
        for name in NASTY:
            self.blocks.add_module(name, nn.Linear(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = torch.tanh(block(x))
        return x


LAYERS = [f"blocks.{n}" for n in NASTY]


def test_torch_refuses_dots_and_empty_names() -> None:
    """What torch itself allows: no ``.`` (so no ``..``) and no empty name in a module key."""
    d = nn.ModuleDict()
    for bad in ("..", "../x", "", "a.b"):
        with pytest.raises(KeyError):
            d.add_module(bad, nn.Identity())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("safe")
    out = base / "stats"
    torch.manual_seed(0)
    model = Nasty()
    inject_observer(model, output_dir=out, sampler=AlwaysSampler())
    try:
        for _ in range(2):
            model(torch.randn(4, 3)).sum().backward()
    finally:
        remove_observer(model)
    return out


def test_names_never_become_paths_or_escape_the_directory(run_dir: Path) -> None:
    base = run_dir.parent
    files = [p for p in base.rglob("*")]
    assert files
    for path in files:
        resolved = path.resolve()
        assert resolved.is_relative_to(run_dir.resolve()), path
        assert not path.is_symlink()
        for fragment in ("passwd", "script", "heading", "col", "rtl", "root"):
            assert fragment not in path.name, path
    assert {p.name for p in run_dir.iterdir()} == {
        "history.parquet",
        "histograms.parquet",
        "events.parquet",
        "result.json",
        "index.md",
        "tensorboard",
    }
    assert not Path("/etc/passwd.parquet").exists()


def test_result_json_is_strict_and_round_trips_the_names(run_dir: Path) -> None:
    records = load_strict_json(run_dir / "result.json")  # rejects NaN/Infinity tokens
    validate_result_json(records)
    assert [r["layer"] for r in records] == LAYERS
    history = scan_history(run_dir).collect()
    assert sorted(history.get_column("layer").unique().to_list()) == sorted(LAYERS)
    histograms = pl.read_parquet(run_dir / "histograms.parquet")
    assert set(histograms.get_column("layer").unique()) <= set(LAYERS)


def test_index_md_stays_well_formed(run_dir: Path) -> None:
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "<script" not in index.lower()
    assert "<img" not in index.lower()
    assert "\x00" not in index
    assert "\u202e" not in index
    fences = [line for line in index.splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0
    assert all(re.fullmatch(r"```[a-z]*", line) for line in fences), fences
    # no name opens a heading: every heading is one the renderer wrote
    headings = [line for line in _outside_fences(index).splitlines() if line.startswith("#")]
    assert not any("heading" in h for h in headings), headings
    # table rows keep their column count (a name's '|' is escaped)
    for line in _outside_fences(index).splitlines():
        if line.startswith("|") and "tick" in line:
            assert "\\| col \\|" in line, line


def _outside_fences(markdown: str) -> str:
    return re.sub(r"^```[a-z]*\n.*?^```$", "", markdown, flags=re.S | re.M)


def test_tensorboard_tags_are_readable_and_reversible(run_dir: Path) -> None:
    events = list((run_dir / "tensorboard").iterdir())
    assert len(events) == 1
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()
    tags = acc.Tags()["histograms"]
    assert tags
    seen = set()
    for tag in tags:
        parts = tag.split("/")
        assert len(parts) == 3, tag  # layer / call / signal: names add no separator
        assert not any(c in tag for c in "\n\t\x00\u202e<>")
        layer = unquote(parts[0])
        assert layer in LAYERS, (tag, layer)
        assert parts[1].startswith("call")
        assert unquote(parts[2]) in ("output", "output_gradient")
        assert len(acc.Histograms(tag)) == 2  # both steps
        seen.add(layer)
    assert seen == set(LAYERS)


def _imports_and_calls(package_dir: Path) -> tuple[set[str], set[str]]:
    imported: set[str] = set()
    called: set[str] = set()
    for path in package_dir.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name):
                    called.add(f.id)
                elif isinstance(f, ast.Attribute):
                    called.add(ast.unparse(f))
    return imported, called


@pytest.mark.parametrize("package", [ti_io, ti_schema], ids=lambda p: p.__name__)
def test_readers_never_unpickle_or_execute(package: object) -> None:
    directory = Path(package.__file__).parent  # type: ignore[attr-defined]
    imported, called = _imports_and_calls(directory)
    unsafe = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib", "yaml", "torch"}
    assert not {m for m in imported if m.split(".")[0] in unsafe}, imported
    assert not called & {"eval", "exec", "compile", "torch.load", "pickle.load", "pickle.loads"}
    assert not any("read_pickle" in c or "from_pickle" in c for c in called)
