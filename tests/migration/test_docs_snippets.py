"""Every code block of docs/migration.md runs.

Python blocks run with a ``model``, a ``train(model)`` loop and a TensorBoard ``writer`` in
scope, each in a fresh working directory; a block that only reads ``stats/`` (it attaches no
observer) finds a run there. Blocks marked ``# before: torchinstruments 0.8.0``, and blocks that
read a 0.8.0 run (``old-stats``), need the released torchinstruments 0.8.0 (the ``legacy`` nox
session) and are skipped without it. ``bash`` blocks run their ``ti ...`` commands.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from ti_core import AlwaysSampler, has_observer, inject_observer, remove_observer

DOC = Path(__file__).resolve().parents[2] / "docs" / "migration.md"
BEFORE = "# before: torchinstruments 0.8.0"
HAS_080 = importlib.util.find_spec("torchinstruments") is not None


def blocks() -> list[tuple[str, str, int]]:
    """(language, code, line) of every fenced block, indented ones (in lists) too."""
    text = DOC.read_text(encoding="utf-8")
    found = []
    pattern = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
    for match in pattern.finditer(text):
        indent = len(match.group(1))
        code = "\n".join(line[indent:] for line in match.group(3).splitlines())
        found.append((match.group(2), code, text[: match.start()].count("\n") + 1))
    return found


def needs_080(code: str) -> bool:
    return code.startswith(BEFORE) or "old-stats" in code


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def train(model: nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def write_current_run(directory: Path) -> None:
    model = small_model()
    inject_observer(model, output_dir=directory, sampler=AlwaysSampler())
    train(model)
    remove_observer(model)


def write_080_run(directory: Path) -> None:
    import torchinstruments

    model = small_model()
    torchinstruments.inject_observer(
        model, output_dir=directory, sampler=torchinstruments.AlwaysSampler()
    )
    train(model)
    torchinstruments.remove_observer(model)


def ti(command: str) -> None:
    args = shlex.split(command)
    assert args[0] == "ti", command
    done = subprocess.run(
        [sys.executable, "-m", "ti_io.cli", *args[1:]], capture_output=True, text=True
    )
    assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def run_block(language: str, code: str, cwd: Path) -> None:
    if "old-stats" in code:
        write_080_run(cwd / "old-stats")
    elif "stats" in code and "inject_observer" not in code:
        write_current_run(cwd / "stats")
    if language == "bash":
        for line in code.splitlines():
            for command in line.split("&&"):
                if command.strip():
                    ti(command.strip())
        return
    model = small_model()
    writer = SummaryWriter(str(cwd / "tb"))
    namespace: dict[str, Any] = {"model": model, "train": train, "writer": writer}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the adapted 0.8.0 forms warn
            exec(compile(code, str(DOC), "exec"), namespace)  # the doc's own code
    finally:
        writer.close()
        if has_observer(model):
            remove_observer(model)
        if HAS_080:
            import torchinstruments

            torchinstruments.remove_observer(model)


SNIPPETS = [b for b in blocks() if b[0] in ("python", "bash")]


def test_the_doc_has_before_and_after_snippets() -> None:
    assert len(SNIPPETS) >= 15
    assert sum(needs_080(code) for _, code, _ in SNIPPETS) >= 6


@pytest.mark.parametrize(
    ("language", "code"),
    [pytest.param(lang, code, id=f"line{line}") for lang, code, line in SNIPPETS],
)
def test_snippet_runs(
    language: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if needs_080(code) and not HAS_080:
        pytest.skip("needs the released torchinstruments 0.8.0 (nox -s legacy installs it)")
    monkeypatch.chdir(tmp_path)
    run_block(language, code, tmp_path)
