"""The ``input`` signal (a call signal: ``ti_core.capture.signals``): each selected module's
positional and keyword tensor arguments, as the call starts, measured exactly against numpy
float64, with the output's path rules; eager (every way a call is captured) and compiled; off
by default; unsampled forwards pay nothing; a failing signal spares the rest."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _core_helpers import assert_matches, reference, rows, stats
from torch import nn

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    MemorySink,
    TelemetryWarning,
    inject_observer,
    remove_observer,
)
from ti_core.call_signals import CallSignal
from ti_core.capture import signals as signals_package
from ti_core.capture.hooks import CallOverride, StartingCallOverride
from ti_core.capture.signals import CALL_SIGNALS, discover

WITH_INPUT = ("output", "output_gradient", "input")
EVERY = lambda name, module: True  # noqa: E731 - a selector


class Gated(nn.Module):
    """Positional, keyword, nested and non-tensor arguments; an in-place activation, whose
    input the forward overwrites."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(
        self,
        x: torch.Tensor,
        pair: tuple[torch.Tensor, int],
        *,
        mask: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> torch.Tensor:
        h = self.act(self.fc(x + pair[0]))
        return h * scale if mask is None else h * mask * scale


class OwnCall(nn.Linear):
    """A class with its own ``__call__``: captured by forward hooks (and a pre-hook)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Gated()
        self.own = OwnCall(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x > 0).float()
        h = self.block(x, (x * 2, 7), mask=mask, scale=0.5)
        h = self.own(h) + self.own(h * 3)  # called twice: call_index 0 and 1
        return self.head(h)


def _inputs(model: Net, x: torch.Tensor) -> dict[tuple[str, int, str], np.ndarray]:
    """Every selected call's tensor arguments as it starts, by (layer, call, path), recorded
    by hand with pre-hooks (the reference)."""
    seen: dict[tuple[str, int, str], np.ndarray] = {}
    calls: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():

        def pre(module: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            call = calls.get(name, 0)
            calls[name] = call + 1
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    seen[(name, call, f"[{i}]")] = a.detach().double().numpy().copy()
                elif isinstance(a, tuple):
                    for j, b in enumerate(a):
                        if isinstance(b, torch.Tensor):
                            seen[(name, call, f"[{i}][{j}]")] = b.detach().double().numpy().copy()
            for k, v in kwargs.items():
                if isinstance(v, torch.Tensor):
                    seen[(name, call, f"[{k!r}]")] = v.detach().double().numpy().copy()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return seen


def _observed(model: nn.Module, x: torch.Tensor, **options: Any) -> Any:
    sink = MemorySink()
    inject_observer(model, sink=sink, output_dir=None, **options)
    try:
        loss = model(x).sum()
        if loss.requires_grad:
            loss.backward()
    finally:
        remove_observer(model)
    return sink.table()


@pytest.mark.parametrize("direct", [False, True], ids=["call-overrides", "forward-overrides"])
def test_every_tensor_argument_is_measured_exactly_as_the_call_starts(direct: bool) -> None:
    torch.manual_seed(3)
    model = Net()
    x = torch.randn(5, 4)
    want = _inputs(model, x)
    table = _observed(
        model,
        x,
        signals=WITH_INPUT,
        selector=EVERY,
        sampler=AlwaysSampler(),
        capture_direct_forwards=direct,
    )
    got = {(r["layer"], r["call_index"], r["tensor_path"]) for r in rows(table, signal="input")}
    assert got == set(want)
    # the paths: positional [i], nested [i][j], keyword ['name']; non-tensor arguments skipped
    assert {p for layer, _, p in got if layer == "block"} == {"[0]", "[1][0]", "['mask']"}
    assert {c for layer, c, _ in got if layer == "own"} == {0, 1}
    for (layer, call, path), values in want.items():
        measured = stats(table, signal="input", layer=layer, call_index=call, tensor_path=path)
        assert_matches(measured, reference(values), rtol=1e-12)
    # the in-place ReLU overwrote its input after the call started: its negative entries
    act = stats(table, signal="input", layer="block.act", tensor_path="[0]")
    assert act["min"] is not None
    assert act["min"] < 0


def test_input_is_off_by_default_and_costs_unsampled_forwards_nothing() -> None:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(5, 4)
    table = _observed(model, x, selector=EVERY, sampler=AlwaysSampler())
    assert not rows(table, signal="input")

    sink = MemorySink()
    inject_observer(
        model,
        sink=sink,
        output_dir=None,
        signals=WITH_INPUT,
        selector=EVERY,
        sampler=EveryNForwardsSampler(3),
    )
    model(x)  # forward 0: sampled
    assert type(model.head.__dict__["_call_impl"]) is StartingCallOverride
    model(x)  # forward 1: unsampled, per-module capture removed
    assert "_call_impl" not in model.head.__dict__
    assert not model.own._forward_pre_hooks
    remove_observer(model)
    samples = {r["sample_id"] for r in rows(sink.table(), signal="input")}
    assert samples == {0}
    # without a call signal, the plain override: nothing is read as a call starts
    inject_observer(model, sink=MemorySink(), output_dir=None, sampler=AlwaysSampler())
    model(x)
    assert type(model.head.__dict__["_call_impl"]) is CallOverride
    remove_observer(model)
    assert "_call_impl" not in model.head.__dict__
    assert not model.own._forward_pre_hooks
    assert not model.own._forward_hooks


def test_the_root_and_compiled_models_record_the_same_inputs(tmp_path: Path) -> None:
    """Root selected (its arguments from the root pre-hook); ``torch.compile(model)`` and
    ``model.compile()`` record the rows eager capture does."""
    x = torch.randn(6, 4)

    def table(mode: str) -> list[tuple[Any, ...]]:
        torch.manual_seed(1)
        model: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
        if mode == "compiled":
            model = torch.compile(model)
        sink = MemorySink()
        inject_observer(
            model,
            sink=sink,
            output_dir=None,
            signals=WITH_INPUT,
            selector=EVERY,
            sampler=EveryNForwardsSampler(2),
        )
        if mode == "compiled_after":
            model.compile()
        for _ in range(4):
            model(x).sum().backward()
        remove_observer(model)
        found = rows(sink.table(), signal="input")
        return sorted(
            (r["sample_id"], r["layer"], r["call_index"], r["tensor_path"], r["metric"], r["value"])
            for r in found
        )

    eager = table("eager")
    assert {(s, layer) for s, layer, *_ in eager} == {
        (s, layer) for s in (0, 1) for layer in ("", "0", "1", "2")
    }
    root = [r for r in eager if r[1] == "" and r[4] == "mean"]
    assert root[0][5] == pytest.approx(float(x.double().mean()), rel=1e-12)
    relu_min = next(r[5] for r in eager if r[1] == "1" and r[4] == "min")
    assert relu_min < 0  # measured before the in-place ReLU ran
    torch._dynamo.reset()
    assert table("compiled") == eager
    torch._dynamo.reset()
    assert table("compiled_after") == eager


def test_a_failing_call_signal_spares_the_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: Any, kwargs: Any, walk: Any) -> list[tuple[str, torch.Tensor]]:
        raise RuntimeError("no arguments today")

    monkeypatch.setitem(CALL_SIGNALS, "input", CallSignal("input", broken))
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = _observed(
            model, torch.randn(3, 4), signals=WITH_INPUT, selector=EVERY, sampler=AlwaysSampler()
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, TelemetryWarning)]
    assert any("input capture" in m and "no arguments today" in m for m in messages), messages
    assert not rows(table, signal="input")
    assert rows(table, signal="output", layer="head")


def test_a_call_signal_is_one_module_found_at_import(tmp_path: Path) -> None:
    assert list(CALL_SIGNALS) == ["input"]
    assert CALL_SIGNALS["input"].name == "input"
    package = tmp_path / "plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "ok.py").write_text(
        "from ti_core.call_signals import CallSignal\n"
        "SIGNAL = CallSignal('input', lambda args, kwargs, walk: walk(args))\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        found = discover("plugins", [str(package)])
        assert list(found) == ["input"]
        (package / "twin.py").write_text((package / "ok.py").read_text())
        with pytest.raises(ValueError, match="two modules of plugins declare the signal 'input'"):
            discover("plugins", [str(package)])
        (package / "twin.py").unlink()
        (package / "stranger.py").write_text(
            "from ti_core.call_signals import CallSignal\n"
            "SIGNAL = CallSignal('weights', lambda args, kwargs, walk: [])\n"
        )
        with pytest.raises(ValueError, match="'weights', which ti-schema does not"):
            discover("plugins", [str(package)])
        (package / "stranger.py").unlink()
        (package / "empty.py").write_text("X = 1\n")
        with pytest.raises(ValueError, match="defines no SIGNAL"):
            discover("plugins", [str(package)])
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "plugins" or m.startswith("plugins.")]:
            del sys.modules[name]
    assert signals_package.call_signals(["output", "input"]) == (CALL_SIGNALS["input"],)
    assert signals_package.call_signals(["output"]) == ()


class Flaky(nn.Module):
    """Raises on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("not yet")
        return x * 2


class Retrying(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Flaky()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.child(x + 100)
        except RuntimeError:
            return self.child(x)


class Recursive(nn.Module):
    """Calls itself once, with other arguments: the root's calls return inner first."""

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        if depth == 0:
            return self(x * 100, depth=1) + x
        return x + 1


@pytest.mark.parametrize("direct", [False, True], ids=["call-overrides", "forward-overrides"])
def test_a_call_that_raised_leaves_no_input_and_the_next_call_keeps_its_own(direct: bool) -> None:
    model = Retrying()
    x = torch.ones(2, 3)
    table = _observed(
        model,
        x,
        signals=WITH_INPUT,
        selector=EVERY,
        sampler=AlwaysSampler(),
        capture_direct_forwards=direct,
    )
    child = rows(table, signal="input", layer="child", metric="mean")
    assert [(r["call_index"], r["value"]) for r in child] == [(0, 1.0)]  # not the x + 100
    output = rows(table, signal="output", layer="child", metric="mean")
    assert [(r["call_index"], r["value"]) for r in output] == [(0, 2.0)]


def test_a_root_called_inside_its_own_forward_pairs_each_input_with_its_output() -> None:
    model = Recursive()
    x = torch.ones(3)
    table = _observed(model, x, signals=WITH_INPUT, selector=EVERY, sampler=AlwaysSampler())
    inputs = {r["call_index"]: r["value"] for r in rows(table, signal="input", metric="mean")}
    outputs = {r["call_index"]: r["value"] for r in rows(table, signal="output", metric="mean")}
    # the inner call returns first (call 0): input 100, output 101; the outer: 1 and 102
    assert inputs == {0: 100.0, 1: 1.0}
    assert outputs == {0: 101.0, 1: 102.0}


def test_with_direct_forwards_the_arguments_are_those_forward_receives() -> None:
    """``capture_direct_forwards=True`` reads the arguments inside the ``forward`` override,
    after the module's own pre-hooks (as its output is read before its forward hooks)."""
    torch.manual_seed(0)

    def measured(direct: bool) -> float | None:
        model = nn.Sequential(nn.Linear(3, 3))
        model[0].register_forward_pre_hook(lambda module, args: (args[0] * 0,))
        table = _observed(
            model,
            torch.ones(2, 3),
            signals=WITH_INPUT,
            sampler=AlwaysSampler(),
            capture_direct_forwards=direct,
        )
        return stats(table, signal="input", layer="0")["mean"]

    assert measured(False) == 1.0  # module(...)'s arguments, before its pre-hooks
    assert measured(True) == 0.0
