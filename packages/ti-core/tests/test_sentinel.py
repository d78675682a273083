"""The flight recorder's dense mode (``Sentinel(mode="dense")``: every selected module checked
on every root forward): the non-finite sentinel, its events and the dense capture they set off.
Replay mode, the default, is test_sentinel_replay.py.

Real models and real training steps; events and rows read back from a MemorySink. The flags'
exactness is checked against numpy's ``isfinite`` on tensors with non-finite entries at every
position class (and finite extremes that would overflow a plain sum).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import ti_core
from ti_core import EveryNForwardsSampler, MemorySink, Sentinel, trigger_capture
from ti_core.gate import GateState
from ti_core.sentinel.flags import Flags, flag_values
from ti_schema import validate_events

NEVER = 10**9  # an interval no test reaches: only the first forward and dense captures sample


class Log(nn.Module):
    """``log`` of its input: NaN once the input turns negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Shifted(nn.Module):
    """a -> relu -> b -> (|h| + shift) -> log -> c; ``shift`` < 0 makes ``log`` produce NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.log = Log()
        self.c = nn.Linear(6, 1)
        self.shift = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x)))
        return self.c(self.log(h.abs() + self.shift))


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; its backward returns a NaN gradient once ``poisoned``."""

    poisoned = False

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        if _PoisonGrad.poisoned:
            return torch.full_like(grad, math.nan)
        return grad


class Poison(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PoisonGrad.apply(x)


class BackwardNaN(nn.Module):
    """first -> second -> poison -> head: a NaN that appears first in backward, flowing into
    ``second``'s output (then ``first``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 5)
        self.second = nn.Linear(5, 5)
        self.poison = Poison()
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.poison(self.second(torch.tanh(self.first(x)))))


def _train(
    model: nn.Module, steps: int, before: dict[int, object] | None = None, *, lr: float = 0.0
) -> None:
    """``steps`` real training steps (SGD; with ``lr=0`` no step is taken, so a NaN gradient
    does not reach the weights: 0 * NaN is NaN)."""
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr or 0.1)
    for step in range(steps):
        action = (before or {}).get(step)
        if callable(action):
            action()
        x = torch.rand(4, model_in(model)) + 0.1
        optimizer.zero_grad()
        model(x).sum().backward()
        if lr:
            optimizer.step()


def _train_poisoned_from(model: nn.Module, steps: int, first: int) -> None:
    """``_train`` with ``_PoisonGrad``'s NaN gradients from step ``first`` on; then the
    poison off and the observer removed, whatever happened."""

    def poison() -> None:
        _PoisonGrad.poisoned = True

    try:
        _train(model, steps, {first: poison})
    finally:
        _PoisonGrad.poisoned = False
        ti_core.remove_observer(model)


def model_in(model: nn.Module) -> int:
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return first.in_features


def _attach(model: nn.Module, sink: MemorySink, **options: object) -> None:
    """Observe ``model``; a sentinel (True, or Sentinel(...) without a mode) in dense mode."""
    sentinel = options.get("sentinel")
    if sentinel is True:
        options["sentinel"] = Sentinel(mode="dense")
    elif isinstance(sentinel, Sentinel):
        options["sentinel"] = dataclasses.replace(sentinel, mode="dense")
    ti_core.inject_observer(
        model, sink=sink, output_dir=None, sampler=EveryNForwardsSampler(NEVER), **options
    )


def _events(sink: MemorySink) -> list[dict[str, object]]:
    table = sink.events()
    validate_events(table)
    return table.to_pylist()


def _set_shift(model: Shifted, value: float) -> object:
    def act() -> None:
        model.shift = value

    return act


def test_forward_nan_gives_one_event_naming_the_module_and_a_dense_capture() -> None:
    torch.manual_seed(0)
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink, sentinel=True)
    # forward 5 on: log of a negative value; the NaN then reaches c, and stays (lr > 0 would
    # spread it into the weights; here it stays because shift stays negative).
    _train(model, 12, {5: _set_shift(model, -100.0)})
    ti_core.remove_observer(model)

    events = _events(sink)
    assert len(events) == 1
    event = events[0]
    assert event["kind"] == "nonfinite"
    assert event["forward_index"] == 5
    assert event["signal"] == "output"
    assert event["layer"] == "log"
    assert event["module_type"] == "Log"
    assert event["tensor_path"] == ""
    assert event["layers"] == ["log", "c"]  # every flagged module, in call order
    assert event["dense_first_forward"] == 6
    assert event["dense_forwards"] == 4
    assert event["rank"] == 0

    table = sink.table().to_pylist()
    assert sorted({r["forward_index"] for r in table}) == [0, 6, 7, 8, 9]
    nonfinite = {
        r["forward_index"]: r["value"]
        for r in table
        if r["layer"] == "log" and r["metric"] == "nonfinite_fraction" and r["signal"] == "output"
    }
    assert nonfinite[0] == 0.0
    assert all(nonfinite[k] > 0 for k in (6, 7, 8, 9))


def test_another_event_fires_only_after_a_clean_forward() -> None:
    torch.manual_seed(0)
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=1))
    _train(
        model,
        14,
        {
            3: _set_shift(model, -100.0),  # 3, 4, 5 non-finite: one event
            6: _set_shift(model, 1.0),  # 6..9 clean: re-armed
            10: _set_shift(model, -100.0),  # a second event
        },
    )
    ti_core.remove_observer(model)
    events = _events(sink)
    assert [e["forward_index"] for e in events] == [3, 10]
    assert [e["event_id"] for e in events] == [0, 1]
    assert [e["dense_first_forward"] for e in events] == [4, 11]
    assert {r["forward_index"] for r in sink.table().to_pylist()} == {0, 4, 11}


def test_a_clean_forward_before_the_event_does_not_re_arm_it() -> None:
    """Two forwards, then one backward of both (a siamese step): the first forward's clean
    gradient check ends after the second forward's event, and must not re-arm the sentinel;
    only a clean forward after the event does."""
    torch.manual_seed(0)
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=1))
    # (shift of the first forward, of the second) per step; forwards 3..7 are non-finite
    steps = [(1.0, 1.0), (1.0, -100.0), (-100.0, -100.0), (-100.0, -100.0), (1.0, 1.0)]
    steps.append((-100.0, 1.0))  # forward 10: after the clean 8 and 9, a second event
    for first, second in steps:
        x = torch.rand(4, 6) + 0.1
        model.shift = first
        out = model(x)
        model.shift = second
        (out.sum() + model(x).sum()).backward()
    ti_core.remove_observer(model)
    events = _events(sink)
    assert [(e["forward_index"], e["signal"]) for e in events] == [(3, "output"), (10, "output")]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad-without-backward"])
def test_inference_forwards_re_arm_the_sentinel(grad: bool) -> None:
    """Forwards without a backward: under ``no_grad`` a clean one re-arms at once; with
    gradients enabled, once its autograd graph is gone (its gradient check will never come),
    so the second incident records its event either way."""
    torch.manual_seed(0)
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=1))
    for shift in (1.0, -100.0, 1.0, 1.0, -100.0, 1.0):  # incidents at forwards 1 and 4
        model.shift = shift
        with torch.set_grad_enabled(grad):
            prediction = model(torch.rand(4, 6) + 0.1)
        assert prediction.requires_grad == grad
    ti_core.remove_observer(model)
    assert [e["forward_index"] for e in _events(sink)] == [1, 4]


def test_nan_first_in_backward_names_the_module_it_flows_into() -> None:
    torch.manual_seed(0)
    model = BackwardNaN()
    sink = MemorySink()
    _attach(model, sink, sentinel=True)
    _train_poisoned_from(model, 6, 2)
    events = _events(sink)
    assert len(events) == 1  # forwards 3..5 stay non-finite in backward: no second event
    event = events[0]
    assert event["signal"] == "output_gradient"
    assert event["forward_index"] == 2
    # Gradients arrive in backward order: head's and poison's are finite; poison's backward
    # makes the one flowing into second's output NaN, then first's.
    assert event["layer"] == "second"
    assert event["layers"] == ["second", "first"]
    assert event["dense_first_forward"] == 3


class Halves(nn.Module):
    """Splits its input in two halves: one backward node, two outputs (``output_nr`` 0, 1)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.chunk(x, 2, dim=-1))


class SplitNaN(nn.Module):
    """first -> halves -> (left, poison(right)) -> head: the NaN gradient flows into the right
    half only, then into first's output."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.halves = Halves()
        self.poison = Poison()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right = self.halves(self.first(x))
        return self.head(torch.cat([left, self.poison(right)], dim=-1))


def test_a_backward_nan_in_one_output_of_a_node_names_that_output() -> None:
    model = SplitNaN()
    sink = MemorySink()
    _attach(model, sink, sentinel=True)
    _train_poisoned_from(model, 3, 1)
    (event,) = _events(sink)
    assert (event["signal"], event["forward_index"]) == ("output_gradient", 1)
    # the halves share one backward node: only the right one's gradient is NaN
    assert list(zip(event["layers"], event["tensor_paths"], strict=True)) == [
        ("halves", "[1]"),
        ("first", ""),
    ]


def test_outputs_only_sentinel_ignores_a_backward_nan() -> None:
    model = BackwardNaN()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(signals=("output",)))
    _PoisonGrad.poisoned = True
    try:
        _train(model, 3)
    finally:
        _PoisonGrad.poisoned = False
        ti_core.remove_observer(model)
    assert _events(sink) == []


def test_manual_trigger_records_its_reason_and_samples_the_next_forwards() -> None:
    torch.manual_seed(0)
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink)  # no sentinel: the manual trigger works on its own
    assert ti_core.observer_of(model).state is GateState.IDLE  # type: ignore[union-attr]
    event = None

    def ask() -> None:
        nonlocal event
        event = trigger_capture(model, forwards=3, reason="loss spike at step 4")

    _train(model, 10, {4: ask})
    ti_core.remove_observer(model)
    assert event is not None
    assert event.kind == "manual"
    rows = _events(sink)
    assert len(rows) == 1
    assert rows[0]["kind"] == "manual"
    assert rows[0]["reason"] == "loss spike at step 4"
    assert rows[0]["forward_index"] == 3  # the latest root forward started when asked
    assert rows[0]["layer"] is None
    assert rows[0]["layers"] == []
    assert (rows[0]["dense_first_forward"], rows[0]["dense_forwards"]) == (4, 3)
    assert {r["forward_index"] for r in sink.table().to_pylist()} == {0, 4, 5, 6}


def test_loss_trigger_kind_keeps_the_value_and_defaults_to_dense_forwards() -> None:
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=2))
    _train(model, 2)
    event = trigger_capture(model, reason="loss 9.5 > mean + 3 sd", kind="loss", value=9.5)
    ti_core.remove_observer(model)
    assert event is not None
    (row,) = _events(sink)
    assert (row["kind"], row["value"], row["dense_forwards"]) == ("loss", 9.5, 2)


def test_trigger_without_an_observer_returns_none_and_bad_arguments_raise() -> None:
    model = Shifted()
    assert trigger_capture(model, reason="no observer") is None
    with pytest.raises(ValueError, match="reason"):
        trigger_capture(model, reason="  ")
    with pytest.raises(ValueError, match="forwards"):
        trigger_capture(model, reason="x", forwards=0)
    with pytest.raises(ValueError, match="kind"):
        trigger_capture(model, reason="x", kind="nonfinite")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sentinel="):
        ti_core.inject_observer(model, output_dir=None, sink=MemorySink(), sentinel="on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dense_forwards"):
        Sentinel(dense_forwards=0)
    with pytest.raises(ValueError, match="signals"):
        Sentinel(signals=("parameter",))
    assert not ti_core.has_observer(model)


def test_sentinel_off_changes_nothing_and_on_keeps_capture_installed() -> None:
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink, sentinel=False)
    _train(model, 3)
    observer = ti_core.observer_of(model)
    assert observer is not None
    assert observer.state is GateState.IDLE
    assert "sentinel" not in observer.run.settings
    ti_core.remove_observer(model)
    _attach(model, sink, sentinel=True)
    observer = ti_core.observer_of(model)
    assert observer is not None
    assert observer.state is GateState.CAPTURING
    assert observer.run.settings["sentinel"].startswith("Sentinel(")
    _train(model, 3)
    ti_core.remove_observer(model)
    # every hook and override is gone
    for module in model.modules():
        assert not module._forward_hooks
        assert "_call_impl" not in module.__dict__


def test_a_failing_write_never_breaks_training() -> None:
    class Broken(MemorySink):
        def write_events(self, batch: object) -> None:
            raise OSError("disk full")

    model = Shifted()
    sink = Broken()
    _attach(model, sink, sentinel=True)
    with pytest.warns(ti_core.TelemetryWarning, match="disk full"):
        _train(model, 6, {2: _set_shift(model, -100.0)})
    ti_core.remove_observer(model)
    # the dense capture still happened
    assert {r["forward_index"] for r in sink.table().to_pylist()} == {0, 3, 4, 5}


# ----------------------------------------------------------------------------- the flags


def _flagged(tensor: torch.Tensor) -> bool:
    flags = Flags()
    flags.add(0, "", tensor)
    result = flags.read()
    assert isinstance(result, list)
    return bool(result)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
)
@pytest.mark.parametrize("numel", [1, 7, 4096, 1 << 15, (1 << 20) + 3])
def test_flags_are_exact_against_numpy(dtype: torch.dtype, numel: int) -> None:
    generator = torch.Generator().manual_seed(numel)
    base = torch.randn(numel, generator=generator, dtype=torch.float64)
    finfo = torch.finfo(dtype if not dtype.is_complex else torch.float32)
    # Finite extremes whose plain sum overflows must not flag.
    base[0] = finfo.max
    if numel > 1:
        base[-1] = finfo.max
    tensor = base.to(dtype)
    cases = [tensor]
    for position in sorted({0, numel // 2, numel - 1}):
        for bad in (math.nan, math.inf, -math.inf):
            broken = tensor.clone()
            broken[position] = bad
            cases += [broken, broken[position % 2 :: 2]]  # the second is not contiguous
    for case in cases:
        wide = case.to(torch.complex128 if dtype.is_complex else torch.float64).numpy()
        assert _flagged(case) == (not np.isfinite(wide).all()), (dtype, numel)
        if dtype.is_complex:  # a lazy conjugate (its conj bit set), as ``z.conj()`` returns
            assert _flagged(case.conj()) == (not np.isfinite(wide).all()), (dtype, numel)
    assert not _flagged(tensor)  # the finite extremes


def test_flags_skip_what_cannot_be_non_finite() -> None:
    assert flag_values(torch.arange(5)) == ()
    assert flag_values(torch.ones(3, dtype=torch.bool)) == ()
    assert flag_values(torch.empty(0)) == ()
    assert len(flag_values(torch.zeros(3).to(torch.float8_e4m3fn))) == 2
    narrow = torch.tensor([1.0, math.nan]).to(torch.float8_e5m2)
    assert _flagged(narrow)


# ----------------------------------------------------------------------------- compiled


@pytest.mark.slow
def test_compiled_fullgraph_sentinel_names_the_module() -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=2))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    try:
        torch.manual_seed(1)
        for step in range(7):
            if step == 3:
                model.shift = -100.0
            x = torch.rand(4, 6) + 0.1
            compiled(x).sum().backward()
        assert not counters["graph_break"]
    finally:
        ti_core.remove_observer(model)
        torch._dynamo.reset()
    events = _events(sink)
    assert len(events) == 1
    assert (events[0]["forward_index"], events[0]["signal"], events[0]["layer"]) == (
        3,
        "output",
        "log",
    )
    assert events[0]["layers"] == ["log", "c"]
    assert {r["forward_index"] for r in sink.table().to_pylist()} == {0, 4, 5}


class Sqrt(nn.Module):
    """``sqrt``: finite on the zeros a ReLU makes, its gradient there infinite."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


@pytest.mark.slow
def test_inductor_sentinel_names_the_module_that_went_non_finite() -> None:
    """Under inductor (which reuses a graph's buffers once their last reader ran) the check
    values are read as they were computed: a NaN weight in the fifth block is named there,
    not in the blocks before it (whose buffers later results overwrite), and an infinite
    gradient is named at the module it flows into."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True)) for _ in range(8)]
    model = nn.Sequential(*blocks, nn.Linear(16, 2))
    sink = MemorySink()
    compiled = torch.compile(model, fullgraph=True)  # inductor
    _attach(compiled, sink, sentinel=Sentinel(dense_forwards=1))
    x = torch.randn(8, 16)
    try:
        for step in range(5):
            if step == 3:
                with torch.no_grad():
                    model[4][0].weight[0, 0] = math.nan
            compiled(x).sum().backward()
        assert not counters["graph_break"]
    finally:
        ti_core.remove_observer(compiled)
    (event,) = _events(sink)
    assert (event["forward_index"], event["signal"], event["layer"]) == (3, "output", "4.0")
    assert event["layers"] == ["4.0", "4.1", "5.0", "5.1", "6.0", "6.1", "7.0", "7.1", "8"]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), Sqrt(), nn.Linear(6, 1))

    def run(sentinel: Sentinel, steps: int) -> list[dict[str, object]]:
        torch._dynamo.reset()
        sink = MemorySink()
        compiled = torch.compile(model, fullgraph=True)
        _attach(compiled, sink, sentinel=sentinel)
        try:
            for _ in range(steps):
                compiled(torch.randn(8, 4)).sum().backward()
        finally:
            ti_core.remove_observer(compiled)
            torch._dynamo.reset()
        return _events(sink)

    # one event: no forward's gradients are clean, so it is not re-armed
    (event,) = run(Sentinel(dense_forwards=1), 3)
    assert (event["signal"], event["layer"]) == ("output_gradient", "1")  # sqrt'(0) = inf
    assert event["layers"][0] == "1"
    # outputs only: the graph's gradient checks are not acted on
    assert run(Sentinel(signals=("output",)), 2) == []


class Scale(nn.Module):
    """Multiplies by a buffer: an infinite scale makes its output non-finite."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


@pytest.mark.slow
@pytest.mark.parametrize("order", ["observe-then-compile", "compile-then-observe"])
def test_compiled_sequential_root_checks_every_forward(order: str) -> None:
    """An ``nn.Sequential`` root compiled after it was observed has its root hooks traced into
    the graph (``COMPILED_AHEAD``: the decision for a forward is taken when the previous one
    ends); observed as an ``OptimizedModule`` they run eagerly (``COMPILED``)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    scale = Scale()
    model = nn.Sequential(nn.Linear(4, 4), scale, nn.Tanh(), nn.Linear(4, 1))
    sink = MemorySink()
    if order == "observe-then-compile":
        _attach(model, sink, sentinel=Sentinel(dense_forwards=2))
        target = observed = torch.compile(model, backend="aot_eager", fullgraph=True)
        observed = model
        want = GateState.COMPILED_AHEAD
    else:
        target = observed = torch.compile(model, backend="aot_eager", fullgraph=True)
        _attach(observed, sink, sentinel=Sentinel(dense_forwards=2))
        want = GateState.COMPILED
    try:
        for step in range(9):
            if step == 4:
                scale.k.fill_(math.inf)
            if step == 6:
                scale.k.fill_(1.0)
            target(torch.rand(3, 4)).sum().backward()
        observer = ti_core.observer_of(observed)
        assert observer is not None
        assert observer.state is want
        assert not counters["graph_break"]
    finally:
        ti_core.remove_observer(observed)
        torch._dynamo.reset()
    (event,) = _events(sink)
    assert (event["forward_index"], event["signal"], event["layer"]) == (4, "output", "1")
    assert event["layers"] == ["1"]  # tanh(+-inf) = +-1: finite from there on
    assert {r["forward_index"] for r in sink.table().to_pylist()} == {0, 5, 6}


class SharedTwice(nn.Module):
    """``shared`` (one Linear) called twice, ``middle`` between: a NaN weight in ``shared``
    makes its first call non-finite, then ``middle``, then its second call."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.middle = nn.Tanh()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.middle(self.shared(x)))
        torch._dynamo.graph_break()  # eager: none; compiled: two graphs and eager code
        return self.head(h)


def _shared_twice_events(compile_it: bool) -> tuple[list[dict[str, object]], list[int]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SharedTwice()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=1))
    target = torch.compile(model) if compile_it else model  # inductor, with a graph break
    calls: list[int] = []
    recorder = ti_core.observer_of(model).recorder  # type: ignore[union-attr]
    original = recorder.check_values

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        original(*args, **kwargs)  # type: ignore[arg-type]

    recorder.check_values = counted  # type: ignore[method-assign]
    try:
        for step in range(6):
            if step == 3:
                with torch.no_grad():
                    model.shared.weight[0, 0] = math.nan
            target(torch.randn(3, 4)).sum().backward()
        # gradient accumulation and two backwards after two forwards: the slots the graphs
        # write are never saved for a backward, so autograd accepts both
        with torch.no_grad():
            model.shared.weight[0, 0] = 0.0
        (target(torch.randn(3, 4)).sum() + target(torch.randn(3, 4)).sum()).backward()
        first, second = target(torch.randn(3, 4)).sum(), target(torch.randn(3, 4)).sum()
        first.backward()
        second.backward()
    finally:
        ti_core.remove_observer(model)
        torch._dynamo.reset()
    return _events(sink), calls


@pytest.mark.slow
def test_compiled_slots_name_what_eager_names_across_graphs_and_shared_calls() -> None:
    """Compiled graphs write their output flags into slots, one per call of a module in each
    graph, read once per root forward with the eager checks' (which write slots too once the
    run is compiled): the event is the eager run's, a module called twice is flagged at both
    calls in order, and the graphs hand no values to the ``ti::check`` operator."""
    eager, _ = _shared_twice_events(compile_it=False)
    compiled, fallbacks = _shared_twice_events(compile_it=True)
    assert len(eager) == 1
    assert (eager[0]["forward_index"], eager[0]["signal"], eager[0]["layer"]) == (
        3,
        "output",
        "shared",
    )
    assert eager[0]["layers"] == ["shared", "middle", "shared", "head"]
    keys = ("forward_index", "signal", "layer", "layers", "tensor_paths")
    assert [{k: e[k] for k in keys} for e in compiled] == [{k: e[k] for k in keys} for e in eager]
    assert fallbacks == []


class Checkpointed(nn.Module):
    """first -> checkpoint(inner: Linear -> Tanh) -> head; a NaN weight in ``inner[0]``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = checkpoint(self.inner, self.first(x), use_reentrant=False)
        return self.head(inner)  # type: ignore[no-any-return]


def _events_with_a_nan_weight(
    make: Callable[[], nn.Module],
    weight: Callable[[nn.Module], torch.Tensor],
    *,
    compile_it: bool,
    steps: int,
    nan_at: int,
    rows: Callable[[int], int],
    fullgraph: bool = False,
) -> list[dict[str, object]]:
    """The events of ``steps`` training steps of ``make()`` (observed, then compiled when
    ``compile_it``), with a NaN written into ``weight(model)`` before step ``nan_at``;
    ``rows(step)``: the batch size of each step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=1))
    target = torch.compile(model, fullgraph=fullgraph) if compile_it else model
    try:
        for step in range(steps):
            if step == nan_at:
                with torch.no_grad():
                    weight(model)[0, 0] = math.nan
            target(torch.randn(rows(step), 4)).sum().backward()
    finally:
        ti_core.remove_observer(model)
        torch._dynamo.reset()
    return _events(sink)


def _checkpointed_events(compile_it: bool) -> list[dict[str, object]]:
    return _events_with_a_nan_weight(
        Checkpointed,
        lambda model: model.inner[0].weight,  # type: ignore[index]
        compile_it=compile_it,
        steps=6,
        nan_at=3,
        rows=lambda step: 3 + step,  # new shapes: recompiles
    )


@pytest.mark.slow
def test_compiled_checks_inside_activation_checkpointing_keep_their_order() -> None:
    """Inside ``torch.utils.checkpoint`` a compiled graph cannot write the slots, so those
    checks go to ``ti::check`` with the slots' counter: they fall in place among the slots'
    flags (before ``head``, checked in a slot after them), through recompiles too."""
    eager = _checkpointed_events(compile_it=False)
    compiled = _checkpointed_events(compile_it=True)
    keys = ("forward_index", "signal", "layer", "layers")
    assert [{k: e[k] for k in keys} for e in eager] == [
        {
            "forward_index": 3,
            "signal": "output",
            "layer": "inner.0",
            "layers": ["inner.0", "inner.1", "head"],
        }
    ]
    assert [{k: e[k] for k in keys} for e in compiled] == [{k: e[k] for k in keys} for e in eager]


@pytest.mark.slow
def test_checks_past_the_slots_capacity_fall_back_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With room for one slot (``first``'s) the checks after it go to ``ti::check``, in place."""
    monkeypatch.setattr("ti_core.compiled.slots.CAPACITY", 1)
    eager = _checkpointed_events(compile_it=False)
    compiled = _checkpointed_events(compile_it=True)
    keys = ("forward_index", "signal", "layer", "layers")
    assert [{k: e[k] for k in keys} for e in compiled] == [{k: e[k] for k in keys} for e in eager]


class EmptySlice(nn.Module):
    """Returns no entries (an empty batch slice), and requires grad: nothing to flag."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:0] * 2


class WithEmpty(nn.Module):
    """first -> (an empty slice of it) -> head; a NaN weight in ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.empty = EmptySlice()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.first(x)
        return self.head(first).sum() + self.empty(first).sum()


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [8192, 0])
def test_compiled_checks_of_an_output_without_entries_train_on(
    monkeypatch: pytest.MonkeyPatch, capacity: int
) -> None:
    """A module whose output has no entries (``aminmax`` of it raises) is checked clean in a
    compiled graph, in a slot and through ``ti::check`` alike, output and gradient: training
    goes on, and a later NaN is named at its module as in eager mode."""
    monkeypatch.setattr("ti_core.compiled.slots.CAPACITY", capacity)

    def events(compile_it: bool) -> list[dict[str, object]]:
        return _events_with_a_nan_weight(
            WithEmpty,
            lambda model: model.head.weight,  # type: ignore[union-attr]
            compile_it=compile_it,
            steps=4,
            nan_at=2,
            rows=lambda step: 3,  # one shape: the graph's sizes stay static
            fullgraph=True,
        )

    eager = events(compile_it=False)
    keys = ("forward_index", "signal", "layer", "layers")
    assert [{k: e[k] for k in keys} for e in eager] == [
        {"forward_index": 2, "signal": "output", "layer": "head", "layers": ["head"]}
    ]
    compiled = events(compile_it=True)
    assert [{k: e[k] for k in keys} for e in compiled] == [{k: e[k] for k in keys} for e in eager]


class Rotate(nn.Module):
    """A complex output: ``x @ weight`` as its real part, ``x`` as its imaginary one."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.complex(x @ self.weight, x)


class Lambda(nn.Module):
    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


class ComplexPath(nn.Module):
    """first -> rotate (complex) -> conj (a lazy conjugate) -> magnitude (real) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.rotate = Rotate()
        self.conj = Lambda(torch.conj)
        self.magnitude = Lambda(torch.abs)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.magnitude(self.conj(self.rotate(self.first(x)))))


class Float8Path(nn.Module):
    """first -> narrow (float8_e5m2) -> widen (float32) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.narrow = Lambda(lambda x: x.to(torch.float8_e5m2))
        self.widen = Lambda(lambda x: x.to(torch.float32))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.widen(self.narrow(self.first(x))))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex")
@pytest.mark.parametrize(
    ("make", "weight", "layers"),
    [
        (ComplexPath, "rotate", ["rotate", "conj", "magnitude", "head"]),
        (Float8Path, "first", ["first", "narrow", "widen", "head"]),
    ],
    ids=["complex", "float8"],
)
def test_compiled_graphs_check_complex_and_float8_outputs_as_eager_mode_does(
    make: Callable[[], nn.Module], weight: str, layers: list[str]
) -> None:
    """Complex outputs (a lazy conjugate among them) and float8 ones are checked inside an
    inductor graph as in eager mode: a NaN that starts in a complex output is named there, not
    at the first real module after it, and a float8 output is among the flagged."""

    def events(compile_it: bool) -> list[dict[str, object]]:
        return _events_with_a_nan_weight(
            make,
            lambda model: getattr(model, weight).weight,
            compile_it=compile_it,
            steps=4,
            nan_at=2,
            rows=lambda step: 3,
            fullgraph=True,
        )

    keys = ("forward_index", "signal", "layer", "layers")
    expected = {"forward_index": 2, "signal": "output", "layer": layers[0], "layers": layers}
    for compile_it in (False, True):
        assert [{k: e[k] for k in keys} for e in events(compile_it)] == [expected], compile_it


class ComplexRoot(nn.Module):
    """first -> rotate (complex) -> root (complex ``sqrt``) -> real -> head. Where rotate's
    output is zero, ``sqrt``'s gradient is not finite: the gradient flowing into rotate's
    (complex) output is the first non-finite one, then first's."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.rotate = Rotate()
        self.root = Sqrt()
        self.real = Lambda(torch.real)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.real(self.root(self.rotate(self.first(x)))))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex")
@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_gradients_into_complex_outputs_are_checked_in_compiled_graphs(
    backend: str | None,
) -> None:
    """The gradient into a complex output is checked in eager mode, by ``ti::check_grad``
    (``aot_eager``) and in a gradient slot (inductor) alike: the event names rotate, not
    first, the real module before it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ComplexRoot()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=1))
    target = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    try:
        for step in range(4):
            if step == 2:  # rotate's first column zero from here on: sqrt(0) there
                with torch.no_grad():
                    model.first.weight[0] = 0.0
                    model.first.bias[0] = 0.0
                    model.rotate.weight[:, 0] = 0.0
            target(torch.randn(3, 4)).sum().backward()
    finally:
        ti_core.remove_observer(model)
        torch._dynamo.reset()
    keys = ("forward_index", "signal", "layer", "layers")
    assert [{k: e[k] for k in keys} for e in _events(sink)] == [
        {
            "forward_index": 2,
            "signal": "output_gradient",
            "layer": "rotate",
            "layers": ["rotate", "first"],
        }
    ]


class Vanish(nn.Module):
    """Zeros that carry their input's gradient unchanged (``h - h.detach()``)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.detach()


class InfiniteBackward(nn.Module):
    """first -> tanh | graph break | vanish -> sqrt -> head. ``sqrt``'s gradient at zero is
    infinite: finite into head's and sqrt's outputs, infinite into vanish's (second graph), then
    tanh's and first's (first graph), in that order."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.tanh = nn.Tanh()
        self.vanish = Vanish()
        self.sqrt = Sqrt()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tanh(self.first(x))
        torch._dynamo.graph_break()  # eager: none; compiled: two graphs and eager code
        return self.head(self.sqrt(self.vanish(h)))


def _infinite_backward_events(
    backend: str | None, steps: int
) -> tuple[list[dict[str, object]], int]:
    """Events of ``steps`` steps (``backend`` None: eager), and how often a backward graph
    called ``ti::check_grad``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = InfiniteBackward()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=1))
    target = model if backend is None else torch.compile(model, backend=backend)
    recorder = ti_core.observer_of(model).recorder  # type: ignore[union-attr]
    calls = 0
    original = recorder.check_gradient_finite

    def counted(*args: object) -> None:
        nonlocal calls
        calls += 1
        original(*args)  # type: ignore[arg-type]

    recorder.check_gradient_finite = counted  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            target(torch.randn(3, 4)).sum().backward()
    finally:
        ti_core.remove_observer(model)
        torch._dynamo.reset()
    return _events(sink), calls


@pytest.mark.slow
def test_inductor_backward_graphs_write_gradient_slots_in_arrival_order() -> None:
    """Under inductor the backward graphs check the gradients into slots themselves (no
    ``ti::check_grad`` call), read when the next root forward ends, or at removal: the event
    is the eager run's, in the order the gradients arrived across two graphs and the eager
    check of the root's output between them. ``aot_eager`` (whose backward would bump the
    slots' version) takes the operator, with the same event."""
    eager, _ = _infinite_backward_events(None, 3)
    keys = ("forward_index", "signal", "layer", "layers")
    assert [{k: e[k] for k in keys} for e in eager] == [
        {
            "forward_index": 0,
            "signal": "output_gradient",
            "layer": "vanish",
            "layers": ["vanish", "tanh", "first"],
        }
    ]
    inductor, calls = _infinite_backward_events("inductor", 3)
    assert [{k: e[k] for k in keys} for e in inductor] == [{k: e[k] for k in keys} for e in eager]
    assert calls == 0
    aot, calls = _infinite_backward_events("aot_eager", 3)
    assert [{k: e[k] for k in keys} for e in aot] == [{k: e[k] for k in keys} for e in eager]
    assert calls > 0
    # one step: the slots its backward wrote are read when the observer is removed
    (single,), _ = _infinite_backward_events("inductor", 1)
    assert {k: single[k] for k in keys} == {k: eager[0][k] for k in keys}


def test_a_deferred_flag_read_is_acted_on_one_forward_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The accelerator path without an accelerator: every read is asked for at the end of a
    root forward and acted on at the end of the next (as behind a CUDA event), so the event
    still names the forward the NaN appeared in, and the dense capture starts one forward
    later than on CPU. (The CUDA event itself needs a device; this drives the same code.)"""
    original = Flags.add

    def add_as_if_on_a_device(self: Flags, layer: int, path: str, tensor: torch.Tensor) -> None:
        original(self, layer, path, tensor)
        self.accelerated = True

    monkeypatch.setattr(Flags, "add", add_as_if_on_a_device)
    torch.manual_seed(0)
    model = Shifted()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(dense_forwards=2))
    _train(model, 9, {4: _set_shift(model, -100.0)})
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert (event["forward_index"], event["signal"], event["layer"]) == (4, "output", "log")
    assert event["dense_first_forward"] == 6  # read at the end of forward 5
    assert {r["forward_index"] for r in sink.table().to_pylist()} == {0, 6, 7}
