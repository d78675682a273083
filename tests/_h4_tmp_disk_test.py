"""Faults at the disk: full, made read-only, deleted mid-run.

Training continues under ``error_policy="warn"`` with exactly one warning that names the path and
what was lost; what was already published stays readable; ``raise`` propagates; removal releases
every hook either way. A real full disk is a tiny tmpfs (when this process may mount one); the
portable variant injects ENOSPC at the part writer's write boundary
(``ti_io.write.parts.write_parquet``).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import re
import shutil
import subprocess
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import ti_io.write.parts
from ti_core import (
    AlwaysSampler,
    TelemetryWarning,
    has_observer,
    inject_observer,
    remove_observer,
)
from ti_io import DirectorySink, HistoryConfig, consolidate, scan_history
from ti_schema.testing import load_strict_json

BEFORE, AFTER = 3, 6
"""Training steps before the fault and after it."""


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def _hooks(model: nn.Module) -> list[tuple[str, int, int, bool]]:
    return [
        (n, len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__)
        for n, m in model.named_modules(remove_duplicate=False)
    ]


def _steps(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, n: int) -> None:
    for _ in range(n):
        x = torch.randn(4, 6, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :2]).backward()
        opt.step()


def _plain_params() -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _steps(model, opt, torch.Generator().manual_seed(3), BEFORE + AFTER)
    return [p.detach().clone() for p in model.parameters()]


def _parts(out: Path) -> dict[Path, Any]:
    return {p: pq.read_table(p) for p in sorted(out.glob("*.parts/part-*.parquet"))}


# -- faults ----------------------------------------------------------------------------------


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@contextlib.contextmanager
def _tmpfs(tmp_path: Path, size: str = "1m") -> Iterator[Path]:
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    if not _mount_tmpfs(where, size):
        pytest.skip("cannot mount a tmpfs here (needs root); the injected variant still runs")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory: Path) -> None:
    """Fill the file system holding ``directory`` until the kernel answers ENOSPC."""
    with open(directory / "ballast", "wb") as f:
        chunk = b"\0" * 65536
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
                f.flush()


def _read_only(directory: Path) -> Callable[[], None]:
    """Make ``directory`` and its subdirectories unwritable; return the undo."""
    dirs = [directory, *(p for p in directory.rglob("*") if p.is_dir())]
    if os.geteuid() != 0:
        modes = {d: d.stat().st_mode for d in dirs}
        for d in dirs:
            d.chmod(0o555)
        return lambda: [d.chmod(m) for d, m in modes.items()] and None
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("root ignores permissions and chattr is missing")
    done = subprocess.run([chattr, "+i", *map(str, dirs)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not supported here: {done.stderr.decode().strip()}")
    return lambda: subprocess.run([chattr, "-i", *map(str, dirs)], check=False) and None


def _inject_enospc(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(path: Path, table: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ti_io.write.parts, "write_parquet", full)


# -- the scenario ----------------------------------------------------------------------------


def _scenario(
    out: Path, fault: Callable[[Path], None], policy: str
) -> tuple[nn.Module, list[BaseException], dict[Path, Any], list[torch.Tensor]]:
    """Train BEFORE steps, publish them, apply ``fault``, train AFTER steps, remove.

    Returns the model, the errors that propagated (training step or removal), the parts
    published before the fault, and the final parameters.
    """
    model = _model()
    pristine = _hooks(model)
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=40))
    inject_observer(model, sink=sink, sampler=AlwaysSampler(), error_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    raised: list[BaseException] = []
    try:
        _steps(model, opt, gen, BEFORE)
        sink.flush()
        published = _parts(out)
        assert published
        fault(out)
        for _ in range(AFTER):
            try:
                _steps(model, opt, gen, 1)
            except OSError as error:
                raised.append(error)
                if policy != "raise":
                    raise
    finally:
        try:
            remove_observer(model)
        except OSError as error:
            raised.append(error)
    assert not has_observer(model)
    assert _hooks(model) == pristine  # removal released every hook, fault or not
    return model, raised, published, [p.detach().clone() for p in model.parameters()]


def _run_warn(
    out: Path, fault: Callable[[Path], None]
) -> tuple[list[warnings.WarningMessage], dict[Path, Any], list[BaseException]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, raised, published, params = _scenario(out, fault, "warn")
    assert not raised, raised
    for got, want in zip(params, _plain_params(), strict=True):
        assert torch.equal(got, want)  # training went on, untouched
    telemetry = [w for w in record if issubclass(w.category, TelemetryWarning)]
    return telemetry, published, raised


def _assert_one_clear_warning(telemetry: list[Any], out: Path) -> str:
    assert len(telemetry) == 1, "\n".join(str(w.message)[:300] for w in telemetry)
    message = str(telemetry[0].message)
    assert str(out) in message
    assert "lost" in message
    return message


def _assert_published_still_readable(out: Path, published: dict[Path, Any]) -> None:
    """Every history row published before the fault is still readable: in its part, or in
    history.parquet when removal could consolidate the parts."""
    history = [t for p, t in published.items() if p.parent.name == "history.parts"]
    assert history
    if all(p.exists() for p in published):
        for path, table in published.items():
            assert pq.read_table(path).equals(table), path
        return
    readable = scan_history(out).collect()
    key = ["sample_id", "layer", "signal", "metric", "value"]
    want = pl.from_arrow(pa.concat_tables(history)).select(key)
    assert isinstance(want, pl.DataFrame)
    assert want.join(readable.select(key), on=key, how="anti", nulls_equal=True).height == 0


# -- tests -----------------------------------------------------------------------------------


def test_disk_full_on_a_real_tmpfs_warns_once_and_keeps_what_was_published(
    tmp_path: Path,
) -> None:
    with _tmpfs(tmp_path) as mount:
        out = mount / "stats"
        telemetry, published, _ = _run_warn(out, lambda d: _fill(d.parent))
        message = _assert_one_clear_warning(telemetry, out)
        assert "No space left on device" in message or "ENOSPC" in message
        _assert_published_still_readable(out, published)
        # freeing space and consolidating recovers every published row
        (mount / "ballast").unlink()
        if not (out / "history.parquet").exists() or (out / "history.parts").exists():
            consolidate(out)
        rows = pq.read_table(out / "history.parquet").num_rows
        assert rows >= sum(t.num_rows for p, t in published.items() if "history" in p.parent.name)
        load_strict_json(out / "result.json")


def test_disk_full_injected_at_the_write_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "stats"
    telemetry, published, _ = _run_warn(out, lambda d: _inject_enospc(monkeypatch))
    message = _assert_one_clear_warning(telemetry, out)
    assert os.strerror(errno.ENOSPC) in message
    assert "history rows" in message
    _assert_published_still_readable(out, published)
    monkeypatch.undo()
    consolidate(out) if (out / "history.parts").exists() else None
    assert pq.read_table(out / "history.parquet").num_rows >= sum(
        t.num_rows for p, t in published.items() if p.parent.name == "history.parts"
    )


def test_output_dir_made_read_only_mid_run(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    undo: list[Callable[[], None]] = []
    try:
        telemetry, published, _ = _run_warn(out, lambda d: undo.append(_read_only(d)))
        _assert_one_clear_warning(telemetry, out)
        _assert_published_still_readable(out, published)
    finally:
        for step in undo:
            step()


def test_output_dir_deleted_mid_run(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    telemetry, _, _ = _run_warn(out, shutil.rmtree)
    message = _assert_one_clear_warning(telemetry, out)
    assert "No such file or directory" in message
    assert not (tmp_path / "history.parquet").exists()  # nothing written outside the run dir
    assert [p.name for p in tmp_path.iterdir()] in ([], ["stats"])


@pytest.mark.parametrize("fault", ["enospc", "deleted"])
def test_raise_policy_propagates_and_removal_still_releases_hooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    out = tmp_path / "stats"
    apply: Callable[[Path], None] = (
        (lambda d: _inject_enospc(monkeypatch)) if fault == "enospc" else shutil.rmtree
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", TelemetryWarning)  # raise never downgrades to a warning
        _, raised, published, _ = _scenario(out, apply, "raise")
    assert raised, "error_policy='raise' must propagate the write failure"
    assert all(isinstance(e, OSError) for e in raised)
    assert str(out) in str(raised[0])
    if fault == "enospc":
        _assert_published_still_readable(out, published)


def test_a_copy_of_the_model_is_not_affected_by_a_broken_directory(tmp_path: Path) -> None:
    """A deep copy made mid-run (EMA) keeps training while the original's directory is gone."""
    model = _model()
    out = tmp_path / "stats"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        inject_observer(model, output_dir=out, sampler=AlwaysSampler())
        model(torch.randn(2, 6)).sum().backward()
        ema = copy.deepcopy(model)
        shutil.rmtree(out)
        for _ in range(3):
            model(torch.randn(2, 6)).sum().backward()
            ema(torch.randn(2, 6)).sum().backward()
        remove_observer(model)
    assert not has_observer(ema)
    telemetry = [w for w in record if issubclass(w.category, TelemetryWarning)]
    # exactly one report: the original's sink failing at close, naming the directory and the
    # loss; the copy (no observer) reports nothing
    assert len(telemetry) == 1, "\n".join(str(w.message)[:300] for w in telemetry)
    message = str(telemetry[0].message)
    assert "closing DirectorySink failed" in message
    assert str(out) in message
    assert "No such file or directory" in message
    assert re.search(r"lost [1-9]\d* history rows", message), message
