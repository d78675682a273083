"""Kills of a run on S3, at every object operation: the driver behind the kill tests of
test_io_object_store_writes.py (run as a script, in its own interpreter, with the AWS
environment of the test's moto server).

``python object_store_kills.py URI OUT`` imports torch, ti-core and ti-io once, then forks one
child per case (S3 is first set up in each child, never in this process, so no client crosses
a fork). Each child trains a real model observed through ``DirectorySink`` on ``URI/<case>``;
its filesystem is the real S3 filesystem behind a ``pyarrow.fs.PyFileSystem`` handler that
counts the operations that change the store (an object written, deleted, a prefix deleted)
and SIGKILLs the process just before operation N:

- ``reference``: no kill; records the operations of removal (the last parts, finalization);
- ``training``: 3 steps published (flush), 2 more buffered, then SIGKILL in the training loop;
- ``final-N``: the reference's steps, killed before operation N of ``remove_observer``.

OUT (JSON) records each case: its prefix, how it ended, and the reference's operations. The
test module imports ``_model`` and ``_step`` from here too, so its own runs train the same.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
from torch import nn

from ti_core import AlwaysSampler, inject_observer, observer_of, remove_observer
from ti_io import DirectorySink, HistoryConfig

JOBS = 2
"""Cases run at once (the CI machine has two cores)."""


class KillingHandler(pafs.FileSystemHandler):
    """Delegates to ``inner``; once armed, counts the mutating operations, records them, and
    SIGKILLs the process just before the ``kill_at``-th (1-based)."""

    def __init__(self, inner: pafs.FileSystem, kill_at: int | None) -> None:
        self.inner = inner
        self.kill_at = kill_at
        self.armed = False
        self.trace: list[str] = []

    def _op(self, name: str, path: str) -> None:
        if not self.armed:
            return
        if self.kill_at is not None and len(self.trace) + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.trace.append(f"{name} {path}")

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def get_type_name(self) -> str:
        return "killing-s3"

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self._op("delete_dir", path)
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._op("delete_dir_contents", path)
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("not in these tests")

    def delete_file(self, path: str) -> None:
        self._op("delete_file", path)
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self._op("move", src)
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self._op("copy_file", dest)
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.inner.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        self._op("open_output_stream", path)
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        raise OSError("a run never appends to an object")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(100 + step)
    x = torch.randn(8, 6)
    loss = (model(x) - x[:, :2]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def scenario(uri: str, case: str, kill_at: int | None) -> list[str]:
    """One run at ``uri``; returns the operations of its removal (when not killed)."""
    from ti_io.storage import resolve_location

    real = resolve_location(uri)
    handler = KillingHandler(real.filesystem, kill_at)
    sink = DirectorySink(
        real.path,
        filesystem=pafs.PyFileSystem(handler),
        history_config=HistoryConfig(flush_seconds=None),
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), error_policy="raise"
    )
    for step in range(3):
        _step(model, opt, step)
    observer = observer_of(model)
    assert observer is not None
    sink.flush()  # 3 steps published as parts
    for step in range(3, 5):
        _step(model, opt, step)
    if case == "training":
        os.kill(os.getpid(), signal.SIGKILL)
    handler.armed = True
    remove_observer(model)
    return handler.trace


def main(base: str, out: Path) -> None:
    results: dict[str, Any] = {}
    # The optimizer imports torch._dynamo on first use (seconds): once here, not per child.
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    importlib.import_module("ti_io.finish.consolidate")  # finalization's imports (Polars)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reference, in a child like every case
        os.close(read)
        trace = scenario(f"{base}/reference", "reference", None)
        os.write(write, json.dumps(trace).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise SystemExit(f"the reference run failed (status {status})")
    trace = json.loads(data)
    results["reference"] = {"prefix": f"{base}/reference", "trace": trace}
    cases = [("training", None)] + [(f"final-{n}", n) for n in range(1, len(trace) + 1)]
    running: dict[int, tuple[str, int | None]] = {}
    for case, kill_at in cases:
        if len(running) >= JOBS:
            _reap(running, results, base)
        pid = os.fork()
        if pid == 0:
            try:
                scenario(f"{base}/{case}", case, kill_at)
            finally:
                os._exit(3)  # not killed: the case did not reach its operation
        running[pid] = (case, kill_at)
    while running:
        _reap(running, results, base)
    out.write_text(json.dumps(results, indent=2))


def _reap(running: dict[int, tuple[str, int | None]], results: dict[str, Any], base: str) -> None:
    pid, status = os.wait()
    case, kill_at = running.pop(pid)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    results[case] = {"prefix": f"{base}/{case}", "killed": killed, "kill_at": kill_at}


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
