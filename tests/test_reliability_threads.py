"""Threads and exceptions: concurrent forwards/backwards keep their own samples; a forward that
raises leaves no state behind; unsampled threads do no per-module work."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    MemorySink,
    TelemetryWarning,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_core.capture.sample import Sample
from ti_core.gate import GateState
from ti_core.observer import Observer
from ti_schema.testing import assert_history_conforms

THREADS = 4
ROUNDS = 4


def _reference(values: np.ndarray) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64).ravel()
    p25, p50, p75 = np.percentile(a, [25, 50, 75])
    return {
        "mean": a.mean(),
        "std": a.std(),
        "min": a.min(),
        "max": a.max(),
        "p25": p25,
        "p50": p50,
        "p75": p75,
        "zero_fraction": float(np.mean(a == 0)),
        "nonfinite_fraction": 0.0,
    }


def _assert_stats(rows: list[dict[str, Any]], want: np.ndarray) -> None:
    got = {r["metric"]: r["value"] for r in rows}
    ref = _reference(want)
    assert got.keys() == ref.keys()
    for metric, value in ref.items():
        np.testing.assert_allclose(got[metric], value, rtol=1e-5, atol=1e-9, err_msg=metric)


def _hooks(model: nn.Module) -> list[tuple[str, int, int]]:
    return [
        (n, len(m._forward_hooks), len(m._forward_pre_hooks))
        for n, m in model.named_modules(remove_duplicate=False)
    ]


def _run_threads(work: Any, names: list[str]) -> None:
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(names))

    def target(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as error:  # reported on the main thread
            failures.append(error)

    threads = [threading.Thread(target=target, args=(i,), name=n) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_concurrent_threads_never_mix_gradients_between_samples() -> None:
    """Thread i uses batch size i + 1 (its rows' shape names it) and loss scale i + 1; each
    thread keeps two forwards outstanding and backpropagates them in reverse order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5, dtype=torch.float64), nn.Tanh())
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    gen = torch.Generator().manual_seed(1)
    inputs = {i: torch.randn(i + 1, 3, dtype=torch.float64, generator=gen) for i in range(THREADS)}
    scale = {i: float(i + 1) for i in range(THREADS)}

    def work(i: int) -> None:
        for _ in range(ROUNDS):
            first = model(inputs[i])
            second = model(inputs[i] * 2)
            (scale[i] * (second**2).sum() / 2).backward()
            (scale[i] * (first**2).sum() / 2).backward()

    _run_threads(work, [f"worker-{i}" for i in range(THREADS)])
    remove_observer(model)
    table = sink.table()
    assert_history_conforms(table)
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    assert frame.get_column("sample_id").n_unique() == THREADS * ROUNDS * 2

    weight = model[0].weight.detach().numpy()
    bias = model[0].bias.detach().numpy()
    checked = 0
    for (sample,), part in frame.group_by(["sample_id"]):
        shapes = set(map(tuple, part.get_column("shape").to_list()))
        assert len(shapes) == 1, f"sample {sample} mixes tensors of several threads: {shapes}"
        owner = next(iter(shapes))[0] - 1
        candidates = []
        for factor in (1.0, 2.0):
            x = inputs[owner].numpy() * factor
            pre = x @ weight.T + bias
            out = np.tanh(pre)
            grad_out = scale[owner] * out
            candidates.append((pre, out, grad_out, grad_out * (1 - out**2)))
        out_rows = part.filter(layer="1", signal="output").to_dicts()
        mean = next(r["value"] for r in out_rows if r["metric"] == "mean")
        pre, out, grad_out, grad_pre = min(candidates, key=lambda c: abs(c[1].mean() - mean))
        _assert_stats(out_rows, out)
        _assert_stats(part.filter(layer="0", signal="output").to_dicts(), pre)
        _assert_stats(part.filter(layer="1", signal="output_gradient").to_dicts(), grad_out)
        _assert_stats(part.filter(layer="0", signal="output_gradient").to_dicts(), grad_pre)
        checked += 1
    assert checked == THREADS * ROUNDS * 2


class ByThreadName:
    """Samples exactly the root forwards run by threads whose name starts with ``sampled``."""

    def should_sample(self, forward_index: int) -> bool:
        return threading.current_thread().name.startswith("sampled")


class Probe(nn.Module):
    """Records, per thread, how many forward hooks its sibling modules carry at call time."""

    def __init__(self, siblings: list[nn.Module]) -> None:
        super().__init__()
        self.siblings = siblings
        self.seen: list[tuple[str, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hooks = sum(len(m._forward_hooks) for m in self.siblings)
        self.seen.append((threading.current_thread().name, hooks))
        return x


def test_unsampled_threads_do_no_per_module_work(monkeypatch: pytest.MonkeyPatch) -> None:
    lin, act = nn.Linear(4, 4), nn.ReLU()
    probe = Probe([lin, act])
    model = nn.Sequential(lin, act)
    model.add_module("probe", probe)
    records: dict[str, int] = {}
    original = Sample.record

    def counting_record(self: Sample, *args: Any, **kwargs: Any) -> None:
        name = threading.current_thread().name
        records[name] = records.get(name, 0) + 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(Sample, "record", counting_record)
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=ByThreadName())
    before = _hooks(model)

    # an unsampled forward with no sample outstanding: no per-module hook exists at all
    threading.current_thread().name, main_name = "quiet-main", threading.current_thread().name
    try:
        model(torch.randn(2, 4)).sum().backward()
    finally:
        threading.current_thread().name = main_name
    assert probe.seen == [("quiet-main", 0)]
    assert _hooks(model) == before
    assert sink.table().num_rows == 0

    def work(i: int) -> None:
        for _ in range(ROUNDS):
            model(torch.randn(i + 1, 4)).sum().backward()

    names = ["sampled-0", "sampled-1", "quiet-2", "quiet-3"]
    _run_threads(work, names)
    # quiet threads never reach the per-call capture, even while hooks are installed for the
    # sampled threads; sampled threads record every selected call of every forward
    assert set(records) == {"sampled-0", "sampled-1"}
    assert all(n == ROUNDS * 3 for n in records.values())  # lin, act, probe per forward
    frame = pl.from_arrow(sink.table())
    assert isinstance(frame, pl.DataFrame)
    batch_sizes = {s[0] for s in frame.get_column("shape").to_list()}
    assert batch_sizes == {1, 2}  # rows of threads sampled-0 and sampled-1 only
    assert frame.get_column("sample_id").n_unique() == 2 * ROUNDS

    # after the sampled threads are done, the next unsampled forward removes the module hooks
    probe.seen.clear()
    threading.current_thread().name = "quiet-main"
    try:
        model(torch.randn(2, 4))
    finally:
        threading.current_thread().name = main_name
    assert _hooks(model) == before
    remove_observer(model)
    assert all(n == 0 and p == 0 for _, n, p in _hooks(model))


class Exploding(nn.Module):
    """Raises inside a nested submodule in the middle of the forward when ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.inner = nn.Sequential(nn.Tanh(), nn.Linear(4, 4))
        self.last = nn.Linear(4, 2)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(self.first(x))
        if self.armed:
            raise ValueError("bad batch in the middle of the forward")
        return self.last(h)


def _observer(model: nn.Module) -> Observer:
    observer = observer_of(model)
    assert observer is not None
    return observer


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_exception_mid_forward_leaves_no_state_and_next_forward_is_observed(
    tmp_path: Path, policy: str
) -> None:
    torch.manual_seed(0)
    model = Exploding()
    pristine = _hooks(model)
    pristine_attributes = set(model.__dict__)
    out = tmp_path / "stats"
    inject_observer(model, output_dir=out, sampler=EveryNForwardsSampler(2), error_policy=policy)
    observer = _observer(model)
    root_only = _hooks(model)
    x = torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TelemetryWarning)  # the model's error is not telemetry's
        model.armed = True
        with pytest.raises(ValueError, match="middle of the forward"):
            model(x)  # forward 0: sampled, raises after first and inner ran
        assert observer.gate.current_sample is None
        assert observer.gate.depth == 0
        assert observer.gate.in_flight == 0
        model.armed = False
        model(x).sum().backward()  # forward 1: unsampled, uninstalls the per-module hooks
        assert _hooks(model) == root_only
        assert observer.state is GateState.IDLE
        y = model(x * 3)  # forward 2: sampled normally
        y.sum().backward()
        remove_observer(model)
    assert _hooks(model) == pristine
    assert observer_of(model) is None
    assert set(model.__dict__) == pristine_attributes

    history = pl.read_parquet(out / "history.parquet")
    # the failed forward emitted what it measured before the error; no gradients for it
    failed = history.filter(forward_index=0)
    assert set(failed.get_column("signal").unique()) == {"output"}
    assert set(failed.get_column("layer").unique()) == {"first", "inner.0", "inner.1"}
    assert failed.get_column("value").null_count() < failed.height  # measured, not only gaps
    ok = history.filter(forward_index=2)
    assert set(ok.get_column("layer").unique()) == {"first", "inner.0", "inner.1", "last"}
    assert set(ok.get_column("signal").unique()) == {"output", "output_gradient"}
    with torch.no_grad():
        want = model(x * 3).numpy()
    got = {r["metric"]: r["value"] for r in ok.filter(layer="last", signal="output").to_dicts()}
    np.testing.assert_allclose(got["mean"], want.mean(), rtol=1e-5)
    np.testing.assert_allclose(got["p75"], np.percentile(want, 75), rtol=1e-5)
    assert history.get_column("forward_index").unique().sort().to_list() == [0, 2]


class ThreadExploding(Exploding):
    """Raises only in the thread whose ``local.armed`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.armed = getattr(self.local, "armed", False)
        h = self.inner(self.first(x))
        if getattr(self.local, "armed", False):
            raise ValueError("bad batch in the middle of the forward")
        return self.last(h)


def test_exception_in_one_thread_does_not_disturb_the_others() -> None:
    torch.manual_seed(0)
    model = ThreadExploding()
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    raised: list[str] = []

    def work(i: int) -> None:
        for r in range(ROUNDS):
            x = torch.randn(i + 1, 3)
            model.local.armed = i == 0 and r % 2 == 0
            try:
                y = model(x)
            except ValueError:
                raised.append(threading.current_thread().name)
                continue
            y.sum().backward()

    _run_threads(work, [f"t{i}" for i in range(THREADS)])
    observer = _observer(model)
    assert observer.gate.in_flight == 0
    remove_observer(model)
    assert raised == ["t0"] * (ROUNDS // 2)
    frame = pl.from_arrow(sink.table())
    assert isinstance(frame, pl.DataFrame)
    grads = frame.filter(signal="output_gradient", layer="last", metric="mean")
    # every successful forward got exactly its own backward's gradient rows
    successful = THREADS * ROUNDS - ROUNDS // 2
    assert grads.height == successful
    assert grads.get_column("sample_id").n_unique() == successful
    # the failed forwards of t0 (batch size 1) emitted outputs but no gradients
    failed = frame.filter(signal="output", layer="inner.1", metric="mean")
    assert failed.height == THREADS * ROUNDS
