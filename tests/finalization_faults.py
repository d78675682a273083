"""Fault injection into finalization, at every file operation: the driver behind
tests/test_reliability_finalization.py (run as a script, in its own interpreter).

``python finalization_faults.py BASE JOBS`` imports torch, ti-core and ti-io once, then forks
the processes of each case (``JOBS`` cases at once), so each is a real process that pays for no
interpreter start:

- a *reference* child runs the scenario with a recording hook: the list of file operations
  (the trace) and the uninterrupted result;
- a *kill* child runs it again and SIGKILLs itself just before operation N (so the disk is as
  that process left it after operation N - 1), for every N of the trace;
- a *fail* child makes operation N fail once, with EIO, ENOSPC or EACCES in turn (and each
  kind of operation with each of them at least once), and records what the program said (the
  warning or the command's message, and the command it names);
- after each, the recovery runs `ti consolidate` (the command the message named, while the
  program that failed still runs; the plain command after a kill) and `ti validate`, through
  ``ti_io.cli.main``, the ``ti`` command, in the process that forked the child.

Three scenarios: ``remove_observer`` on a live run (2 steps' rows still buffered in memory, 3
already published as parts), ``consolidate`` of a run whose process was killed after
publishing everything, and ``skip_damaged``: `ti consolidate --skip-damaged` of that killed
run with one bit flipped in a history part (kill cases only; recovered with the same command;
run by tests/test_reliability_integrity.py). BASE/results.json says what happened; the test
compares every recovered directory with the reference.

The operations are what Python's audit hooks see on paths inside the run directory: ``open``
(any mode, also of a directory to fsync it), ``os.rename`` (``os.replace`` too),
``os.remove``, ``os.rmdir``, ``os.mkdir``, ``os.listdir``, ``os.scandir``, ``fcntl.flock``,
plus ``os.fsync``, which has no audit event: the children wrap it to raise one
(``sys.audit("os.fsync", fd)``) before calling the real fsync. pyarrow's C++ writer and reader
open, write and close files without audit events: it only ever writes a temporary file (the
Python code then fsyncs and renames it), so a kill while it writes leaves the disk as a kill
just before the next operation (the fsync's ``open``) leaves it, minus a partial temporary
that nothing reads. Reads of final files (Polars, pyarrow) are not counted either.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from torch import nn

from ti_core import (
    AlwaysSampler,
    RankSelection,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_io import DirectorySink, HistoryConfig
from ti_io.cli import main as ti
from ti_schema.layout import PART_PATTERN

EVENTS = frozenset(
    {
        "open",
        "os.rename",
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.listdir",
        "os.scandir",
        "os.fsync",
        "fcntl.flock",
        "os.truncate",
        "os.chmod",
        "os.link",
        "os.symlink",
        "shutil.rmtree",
    }
)
ERRNOS = (errno.EIO, errno.ENOSPC, errno.EACCES)
TEMP_NAME = re.compile(r"\.\d+-\d+-\d+\.ti-tmp")
COMMAND = re.compile(r"`(ti consolidate[^`]*)`")
SKIP_DAMAGED = "--skip-damaged"


class Injector:
    """The audit hook of a child: counts operations under ``root`` and records, kills or
    fails at one of them."""

    def __init__(self, root: Path, mode: str, at: int = 0, error: int = 0) -> None:
        self.root = str(root)
        self.mode = mode
        self.at = at
        self.error = error
        self.count = 0
        self.trace: list[list[str]] = []
        self.renamed_parts: list[dict[str, Any]] = []
        self.failed: str | None = None
        self._inside = False

    def install(self) -> None:
        real = os.fsync

        def fsync(fd: int) -> None:
            sys.audit("os.fsync", fd)
            real(fd)

        os.fsync = fsync
        sys.addaudithook(self.hook)

    @staticmethod
    def _path(event: str, args: tuple[Any, ...]) -> str | None:
        if not args:
            return None
        target = args[0]
        if isinstance(target, int):
            try:
                return os.readlink(f"/proc/self/fd/{target}")  # no audit event
            except OSError:
                return None
        if isinstance(target, bytes):
            return os.fsdecode(target)
        if isinstance(target, str | os.PathLike):
            return os.path.abspath(os.fspath(target))
        return None

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in EVENTS or self._inside:
            return
        path = self._path(event, args)
        if path is None or not (path == self.root or path.startswith(self.root + os.sep)):
            return
        self.count += 1
        if self.mode == "record":
            self._inside = True
            try:
                self._record(event, path, args)
            finally:
                self._inside = False
        elif self.count == self.at and self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.count == self.at and self.mode == "fail":
            self.failed = f"{event} {os.path.relpath(path, self.root)}"
            raise OSError(self.error, os.strerror(self.error), path)

    def _record(self, event: str, path: str, args: tuple[Any, ...]) -> None:
        relative = TEMP_NAME.sub(".TMP.ti-tmp", os.path.relpath(path, self.root))
        self.trace.append([event, relative])
        if event == "os.rename" and len(args) > 1:
            destination = Path(os.fspath(args[1]))
            if PART_PATTERN.fullmatch(destination.name):
                rows = pq.read_metadata(path).num_rows  # pyarrow's reads raise no events
                kind = destination.parent.name.split(".")[0]
                self.renamed_parts.append({"op": self.count, "kind": kind, "rows": rows})


# -- the scenarios ---------------------------------------------------------------------------


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 4)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :3]).backward()
    opt.step()


class OneProcess:
    """The rank policy of a single process, given as an object: no entry-point lookup."""

    def select(self) -> RankSelection:
        return RankSelection(rank=0, world_size=1, observe=True, subdir=None)

    def __repr__(self) -> str:  # index.md records it: the same in every case
        return "OneProcess()"


def live_run(run: Path) -> nn.Module:
    """Three steps published as parts, two more buffered in the sink (nothing in flight)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    sink = DirectorySink(run, history_config=HistoryConfig(buffer_rows=400, flush_seconds=None))
    inject_observer(
        model,
        sink=sink,
        sampler=AlwaysSampler(),
        max_histogram_modules=2,
        rank_policy=OneProcess(),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        _step(model, opt)
    sink.flush()
    for _ in range(2):  # 2 x 54 history rows < buffer_rows: they stay in the sink's buffer
        _step(model, opt)
    observer = observer_of(model)
    assert observer is not None
    observer.drain()  # the emission worker is idle; the part writer is idle since the flush
    return model


def published_rows(run: Path) -> dict[str, int]:
    rows = {}
    for kind in ("history", "histograms"):
        parts = sorted((run / f"{kind}.parts").glob("part-*.parquet"))
        rows[kind] = sum(pq.read_metadata(p).num_rows for p in parts)
    return rows


def finish_remove_observer(run: Path, injector: Injector) -> dict[str, Any]:
    model = live_run(run)
    base = published_rows(run)
    injector.install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remove_observer(model)
    return {"base": base, "said": [str(w.message) for w in caught]}


def finish_consolidate(run: Path, injector: Injector, *options: str) -> dict[str, Any]:
    injector.install()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ti(["consolidate", *options, str(run)])
    return {"code": code, "said": [out.getvalue(), err.getvalue()]}


def finish_skipping_damaged(run: Path, injector: Injector) -> dict[str, Any]:
    return finish_consolidate(run, injector, SKIP_DAMAGED)


def damage_one_part(run: Path) -> None:
    """One bit flipped in the value page of the run's first history part
    (tests/run_damage.py): the ``skip_damaged`` scenario's damage."""
    spec = importlib.util.spec_from_file_location(
        "run_damage", Path(__file__).with_name("run_damage.py")
    )
    assert spec is not None
    assert spec.loader is not None
    damage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(damage)
    damage.flip_value_bit(sorted((run / "history.parts").glob("part-*.parquet"))[0])


def killed_after_publishing(run: Path) -> None:
    """A run whose process was killed with every row published as parts."""
    model = live_run(run)
    observer = observer_of(model)
    assert observer is not None
    observer.sinks.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# -- processes -------------------------------------------------------------------------------


def in_child(
    work: Callable[[], dict[str, Any]],
    meanwhile: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run ``work`` in a forked child; its JSON result, or how the child ended.

    ``meanwhile(result)`` runs here once the child has reported, while the child still lives
    (the program that failed goes on while the user runs the recovery); its result is added
    as ``"then"``.
    """
    read, write = os.pipe()
    hold_read, hold_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into the driver
        os.close(read)
        os.close(hold_write)
        try:
            result = work()
        except BaseException:
            result = {"exception": traceback.format_exc()}
        with os.fdopen(write, "w") as pipe:
            json.dump(result, pipe)
        os.read(hold_read, 1)  # until the parent is done (EOF)
        os._exit(0)
    os.close(write)
    os.close(hold_read)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    result = json.loads(text) if text else {}
    try:
        if meanwhile is not None and text:
            result["then"] = meanwhile(result)
    finally:
        os.close(hold_write)
        _, status = os.waitpid(pid, 0)
    result["status"] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return result


def recover(run: Path, command: str | None) -> dict[str, Any]:
    """Run the recovery command (`ti consolidate ...`, as the message named it) and `ti
    validate`, as the `ti` command runs them, in this process."""
    words = shlex.split(command) if command else ["ti", "consolidate", str(run)]
    assert words[:2] == ["ti", "consolidate"], words
    done: dict[str, Any] = {"command": shlex.join(words)}
    for name, argv in (("consolidate", words[1:]), ("validate", ["validate", str(run)])):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = ti(argv)
        done[name] = {"code": code, "out": out.getvalue(), "err": err.getvalue()}
    return done


def named_command(said: list[str]) -> str | None:
    for text in said:
        match = COMMAND.search(text)
        if match:
            return match.group(1)
    return None


def failures(trace: list[list[str]]) -> list[tuple[int, int]]:
    """``(operation, errno)`` of the fail cases: every operation fails once, the error cycling
    through ERRNOS, plus, for each kind of operation (open, rename, fsync, ...) that the cycle
    did not give every error, its first occurrence with the missing ones."""
    chosen = [(at, ERRNOS[at % len(ERRNOS)]) for at in range(1, len(trace) + 1)]
    met = {(trace[at - 1][0], error) for at, error in chosen}
    first: dict[str, int] = {}
    for at, (event, _) in enumerate(trace, start=1):
        first.setdefault(event, at)
    chosen += [
        (at, error) for event, at in first.items() for error in ERRNOS if (event, error) not in met
    ]
    return chosen


def scenario(base: Path, name: str, jobs: int) -> dict[str, Any]:
    """The reference, then every kill and fail case of one scenario (``jobs`` at a time)."""
    finish = {
        "remove_observer": finish_remove_observer,
        "consolidate": finish_consolidate,
        "skip_damaged": finish_skipping_damaged,
    }[name]
    prepared = base / name / "prepared"
    if name != "remove_observer":
        in_child(lambda: killed_after_publishing(prepared) or {})
    if name == "skip_damaged":
        damage_one_part(prepared)

    def fresh(case: str) -> Path:
        run = base / name / case
        if name != "remove_observer":
            shutil.copytree(prepared, run)
        return run

    reference = fresh("reference")

    def record() -> dict[str, Any]:
        injector = Injector(reference, "record")
        done = finish(reference, injector)
        return {**done, "trace": injector.trace, "renamed_parts": injector.renamed_parts}

    report: dict[str, Any] = {"reference": in_child(record)}
    trace = report["reference"].get("trace", [])
    cases: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for at in range(1, len(trace) + 1):

        def kill(at: int = at) -> dict[str, Any]:
            run = fresh(f"kill-{at:03d}")
            died = in_child(lambda: finish(run, Injector(run, "kill", at)))
            # `ti consolidate DIR`, as after any crash (with the option the killed one had)
            again = f"ti consolidate {SKIP_DAMAGED} {run}" if name == "skip_damaged" else None
            recovered = recover(run, again)
            return {"mode": "kill", "at": at, "dir": str(run), **died, "recovery": recovered}

        cases.append((f"kill-{at:03d}", kill))
    # skip_damaged: kills only (the failures of the same operations are consolidate's)
    for at, error in failures(trace) if name != "skip_damaged" else []:

        def fail(at: int = at, error: int = error) -> dict[str, Any]:
            run = fresh(f"fail-{at:03d}-{errno.errorcode[error]}")

            def failing() -> dict[str, Any]:
                injector = Injector(run, "fail", at, error)
                done = finish(run, injector)
                return {**done, "failed": injector.failed}

            def recovery(result: dict[str, Any]) -> dict[str, Any]:
                return recover(run, named_command(result.get("said", [])))

            ended = in_child(failing, recovery)  # recovered while the failed program runs on
            recovered = ended.pop("then", {})
            return {
                "mode": "fail",
                "at": at,
                "errno": errno.errorcode[error],
                "dir": str(run),
                **ended,
                "command": named_command(ended.get("said", [])),
                "recovery": recovered,
            }

        cases.append((f"fail-{at:03d}-{errno.errorcode[error]}", fail))
    report["cases"] = run_cases(base / name, cases, jobs)
    return report


def run_cases(
    where: Path, cases: list[tuple[str, Callable[[], dict[str, Any]]]], jobs: int
) -> list[dict[str, Any]]:
    """Run each case in a process of its own, ``jobs`` at once; their reports, in order.

    A case process is forked from the driver (no threads) and forks its own children.
    """
    running: dict[int, int] = {}
    reports = [where / f"{name}.json" for name, _ in cases]

    def reap() -> None:
        pid, _ = os.wait()
        running.pop(pid, None)

    for index, (_, case) in enumerate(cases):
        while len(running) >= jobs:
            reap()
        pid = os.fork()
        if pid == 0:
            try:
                result = case()
            except BaseException:
                result = {"exception": traceback.format_exc()}
            reports[index].write_text(json.dumps(result))
            os._exit(0)
        running[pid] = index
    while running:
        reap()
    return [
        json.loads(path.read_text()) if path.exists() else {"exception": f"no report {path}"}
        for path in reports
    ]


def main() -> None:
    base = Path(sys.argv[1]).resolve()
    jobs = int(sys.argv[2])
    names = sys.argv[3:] or ["remove_observer", "consolidate"]
    torch.set_num_threads(1)  # no intra-op thread pool in the parent of forked children
    # Imported lazily by every case otherwise. torch._dynamo is the large one: the optimizer's
    # first step imports it (with sympy), ~15 s per case without cached bytecode; with it, the
    # whole matrix took 203 s of user CPU importing it in each case, 34 s with it preloaded.
    for module in (
        "pyarrow.dataset",
        "pyarrow.acero",
        "numpy.ma",
        "torch._dynamo",
        "torch.profiler",
    ):
        importlib.import_module(module)
    gc.freeze()  # the children's collections skip the driver's objects: no copy-on-write
    report = {name: scenario(base, name, jobs) for name in names}
    (base / "results.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
