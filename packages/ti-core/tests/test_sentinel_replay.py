"""The flight recorder's replay mode (the default sentinel): checks at the root, a replay of the
step on an event, and its verdict.

Real models and real training steps; events read back from a MemorySink and validated against
the contract. Each verdict is reached the way a user meets it: a NaN made by one call only (a
transient fault), by real numerics in a forward or a backward, by the batch, by the loss; the
replay leaves the training exactly as it would have been without it (RNG, BatchNorm statistics,
``.grad``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import ti_core
from ti_core import EveryNForwardsSampler, MemorySink, Sentinel, observer_of, trigger_capture
from ti_core.gate import GateState
from ti_core.sentinel.flags import Flags, check_all
from ti_schema import validate_events

NEVER = 10**9  # only the first forward and dense captures sample


def _attach(model: nn.Module, sink: MemorySink, **options: object) -> None:
    ti_core.inject_observer(
        model, sink=sink, output_dir=None, sampler=EveryNForwardsSampler(NEVER), **options
    )


def _events(sink: MemorySink) -> list[dict[str, object]]:
    table = sink.events()
    validate_events(table)
    return table.to_pylist()


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Net(nn.Module):
    """inp -> |.| + shift -> log -> out; ``shift`` < 0 makes ``log`` produce NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.log = Log()
        self.out = nn.Linear(8, 1)
        self.shift = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.log(self.inp(x).abs() + self.shift))


class Flaky(nn.Module):
    """Identity, except that call number ``bad`` returns NaN (a fault that happens once)."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.calls = 0
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * math.nan if self.calls == self.bad else x


class _NaNBackward(torch.autograd.Function):
    """Identity forward; a NaN gradient from its backward while ``on``."""

    on = False

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, math.nan) if _NaNBackward.on else grad


class NaNBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NaNBackward.apply(x)


class BackwardNet(nn.Module):
    """first -> tanh -> second -> poison -> head: the poison's backward makes the NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 5)
        self.second = nn.Linear(5, 5)
        self.poison = NaNBackward()
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (x * 1.0: autograd keeps no reference to the batch itself)
        return self.head(self.poison(self.second(torch.tanh(self.first(x * 1.0)))))


@pytest.fixture(autouse=True)
def _poison_off() -> object:
    yield
    _NaNBackward.on = False


def _steps(
    model: nn.Module,
    inputs: int,
    steps: int,
    before: Callable[[int], None] = lambda step: None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[float]:
    """Real training steps; the losses. A non-finite loss skips the optimizer step (as a
    gradient scaler does), so the weights stay finite."""
    data = torch.Generator().manual_seed(7)
    losses = []
    for step in range(steps):
        before(step)
        x = torch.rand(6, inputs, generator=data) + 0.1
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        losses.append(float(loss.detach()))
        if optimizer is not None and math.isfinite(losses[-1]):
            optimizer.step()
    return losses


def test_sentinel_is_on_by_default_in_replay_mode_and_a_clean_run_replays_nothing() -> None:
    torch.manual_seed(0)
    model = Net()
    sink = MemorySink()
    _attach(model, sink)
    observer = observer_of(model)
    assert observer is not None
    assert observer.run.settings["sentinel"] == repr(Sentinel())
    assert Sentinel().mode == "replay"
    _steps(model, 4, 5)
    # nothing per module on a clean step: capture is not installed outside samples
    assert observer.state is GateState.IDLE
    assert observer.recorder._replayer is not None
    assert observer.recorder._replayer.replays == 0
    ti_core.remove_observer(model)
    assert _events(sink) == []


def test_real_numerics_in_a_forward_are_reproduced_and_name_the_module() -> None:
    torch.manual_seed(0)
    model = Net()
    sink = MemorySink()
    _attach(model, sink)

    def shift(step: int) -> None:
        if step == 3:
            model.shift = -100.0

    _steps(model, 4, 6, shift)
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert (event["kind"], event["signal"], event["forward_index"]) == ("nonfinite", "output", 3)
    assert (event["replay"], event["layer"], event["module_type"]) == ("reproduced", "log", "Log")
    assert event["layers"] == ["log", "out"]
    assert "real numerics" in str(event["replay_reason"])
    assert (event["dense_first_forward"], event["dense_forwards"]) == (4, 4)


def test_a_nan_made_by_one_call_only_is_not_reproduced() -> None:
    """A transient fault: the step's output is NaN, its replay (the module's next call) clean."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Flaky(bad=3), nn.Linear(4, 1))
    sink = MemorySink()
    _attach(model, sink)
    _steps(model, 4, 5)
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert (event["signal"], event["forward_index"], event["replay"]) == (
        "output",
        2,
        "not_reproduced",
    )
    # the root's check saw it: the event names the root's output, and the rank and device
    assert (event["layer"], event["module_type"], event["tensor_path"]) == ("", "Sequential", "")
    reason = str(event["replay_reason"])
    assert "rank 0, device cpu" in reason
    assert "transient fault" in reason


def test_the_replay_undoes_what_it_changes_of_plain_module_attributes() -> None:
    """A module counting its calls: the replay's call is not counted (the transient fault of
    call 3 stays a one-off, and the training's calls are numbered as without the replay)."""
    torch.manual_seed(0)
    flaky = Flaky(bad=3)
    model = nn.Sequential(nn.Linear(4, 4), flaky, nn.Linear(4, 1))
    sink = MemorySink()
    _attach(model, sink)
    _steps(model, 4, 5)
    ti_core.remove_observer(model)
    assert flaky.calls == 5
    assert [e["replay"] for e in _events(sink)] == ["not_reproduced"]


def test_a_backward_that_makes_nan_is_reproduced_and_names_its_module() -> None:
    """A custom autograd Function whose backward makes NaN: the replayed backward names the
    module whose backward made it (not the module before it, which only received it); the
    step's ``.grad`` is the same as without the sentinel (the replay accumulates nothing)."""

    def run(sentinel: bool) -> tuple[list[dict[str, object]], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = BackwardNet()
        sink = MemorySink()
        _attach(model, sink, sentinel=sentinel)

        def poison(step: int) -> None:
            _NaNBackward.on = step >= 2

        _steps(model, 5, 3, poison)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        ti_core.remove_observer(model)
        return (_events(sink) if sentinel else []), grads

    events, grads = run(True)
    _, bare = run(False)
    (event,) = events
    assert (event["signal"], event["forward_index"], event["replay"]) == (
        "output_gradient",
        2,
        "reproduced",
    )
    assert (event["layer"], event["module_type"]) == ("poison", "NaNBackward")
    assert "backward of 'poison'" in str(event["replay_reason"])
    assert len(grads) == len(bare)
    for mine, theirs in zip(grads, bare, strict=True):
        assert torch.equal(mine.isnan(), theirs.isnan())
        assert torch.equal(mine.nan_to_num(), theirs.nan_to_num())


def test_a_nan_in_the_batch_is_named_as_the_batchs() -> None:
    torch.manual_seed(0)
    model = Net()
    sink = MemorySink()
    _attach(model, sink)
    for step in range(3):
        x = torch.rand(6, 4) + 0.1
        if step == 1:
            x[2, 1] = math.nan
        model.zero_grad()
        model(x).sum().backward()
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert (event["replay"], event["layer"], event["forward_index"]) == ("reproduced", "", 1)
    assert "came with the batch" in str(event["replay_reason"])
    assert "'inp'" in str(event["replay_reason"])


def test_a_loss_that_is_not_finite_outside_the_model_is_named_as_the_losss() -> None:
    """The model's output is finite, the loss made of it is not (the square root of a negative
    number): the backward check fires and the replay finds the gradient into the output
    already NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    sink = MemorySink()
    _attach(model, sink)
    for step in range(3):
        model.zero_grad()
        out = model(torch.rand(6, 4) + 0.1)
        loss = torch.sqrt(out - 100.0).sum() if step == 1 else out.sum()
        loss.backward()
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert (event["signal"], event["replay"], event["layer"]) == (
        "output_gradient",
        "reproduced",
        "",
    )
    assert "came from the loss" in str(event["replay_reason"])


class DropoutNet(nn.Module):
    """inp -> dropout -> picky -> out: NaN exactly when dropout zeroes entry [0, 0], so only a
    replay with the step's own RNG state reproduces it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.inp(x).abs() + 1.0)
        picky = torch.where(h[:1, :1] == 0, math.nan, 1.0)
        return self.out(h * picky)


def test_dropout_reproduces_with_the_steps_rng_and_training_draws_the_same_masks() -> None:
    def run(sentinel: bool) -> tuple[list[float], list[dict[str, object]]]:
        torch.manual_seed(0)
        model = DropoutNet()
        sink = MemorySink()
        _attach(model, sink, sentinel=sentinel)
        losses = _steps(model, 4, 24)
        ti_core.remove_observer(model)
        return losses, (_events(sink) if sentinel else [])

    losses, events = run(True)
    bare, _ = run(False)
    assert [math.isnan(v) for v in losses] == [math.isnan(v) for v in bare]
    assert [v for v in losses if not math.isnan(v)] == [v for v in bare if not math.isnan(v)]
    assert len(events) >= 4  # about half the steps are non-finite, in several runs of steps
    assert {e["replay"] for e in events} == {"reproduced"}
    assert all(e["layer"] == "" for e in events)  # made by the root's own code, not a module


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.log = Log()
        self.out = nn.Linear(8, 1)
        self.shift = 5.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.log(self.norm(self.inp(x)) + self.shift))


def test_batchnorm_statistics_after_replays_equal_those_of_the_run_without() -> None:
    def run(sentinel: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, object]]]:
        torch.manual_seed(0)
        model = NormNet()
        sink = MemorySink()
        _attach(model, sink, sentinel=sentinel)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

        def shift(step: int) -> None:
            model.shift = -50.0 if step in (3, 4, 8) else 5.0

        _steps(model, 4, 10, shift, optimizer=optimizer)
        model.eval()
        with torch.no_grad():
            model(torch.rand(3, 4))  # an eval forward with its own checks
        ti_core.remove_observer(model)
        return (
            {k: v.clone() for k, v in model.state_dict().items()},
            (_events(sink) if sentinel else []),
        )

    state, events = run(True)
    bare, _ = run(False)
    assert [(e["forward_index"], e["replay"]) for e in events] == [
        (3, "reproduced"),
        (8, "reproduced"),
    ]
    assert state.keys() == bare.keys()
    for key in state:
        assert torch.equal(state[key], bare[key]), key


def test_an_argument_changed_in_place_after_the_forward_is_not_replayable() -> None:
    torch.manual_seed(0)
    model = BackwardNet()
    sink = MemorySink()
    _attach(model, sink)
    _NaNBackward.on = True
    x = torch.rand(6, 5)
    out = model(x)
    x.mul_(2.0)  # the batch reused as a buffer before the backward
    out.sum().backward()
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert (event["signal"], event["replay"]) == ("output_gradient", "not_replayable")
    reason = str(event["replay_reason"])
    assert "args[0]" in reason
    assert "changed in place" in reason
    # the backward check saw every parameter gradient of the selected modules non-finite
    assert event["layer"] == "first"
    assert event["tensor_path"] == "weight.grad"


def test_a_replay_that_raises_is_not_replayable_and_training_goes_on() -> None:
    class Once(nn.Module):
        """NaN on its first call; the second (the replay's) raises; later ones are clean."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[int] = []  # (a list: the replay undoes plain attributes only)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.append(len(self.calls) + 1)
            if len(self.calls) == 2:
                raise RuntimeError("no second call")
            return x * math.nan if len(self.calls) == 1 else x

    torch.manual_seed(0)
    once = Once()
    model = nn.Sequential(nn.Linear(3, 3), once)
    sink = MemorySink()
    _attach(model, sink)
    model(torch.rand(2, 3))
    assert len(once.calls) == 2  # the replay ran
    assert model(torch.rand(2, 3)).isfinite().all()  # training goes on
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert event["replay"] == "not_replayable"
    assert "RuntimeError: no second call" in str(event["replay_reason"])


def test_manual_and_loss_triggers_keep_working_and_carry_no_verdict() -> None:
    torch.manual_seed(0)
    model = Net()
    sink = MemorySink()
    _attach(model, sink)
    _steps(model, 4, 2)
    trigger_capture(model, forwards=2, reason="look here")
    _steps(model, 4, 3)
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert (event["kind"], event["replay"], event["replay_reason"]) == ("manual", None, None)
    # forward 0 (the sampler's first) and the dense capture: forwards 2 and 3
    assert {r["forward_index"] for r in sink.table().to_pylist()} == {0, 2, 3}


def test_dense_mode_is_still_there() -> None:
    torch.manual_seed(0)
    model = Net()
    sink = MemorySink()
    _attach(model, sink, sentinel=Sentinel(mode="dense"))
    observer = observer_of(model)
    assert observer is not None
    assert observer.state is GateState.CAPTURING

    def shift(step: int) -> None:
        if step == 2:
            model.shift = -100.0

    _steps(model, 4, 4, shift)
    ti_core.remove_observer(model)
    (event,) = _events(sink)
    assert (event["layer"], event["replay"]) == ("log", None)


def test_bad_mode_is_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match=r"Sentinel\(mode=...\) got 'fast'"):
        Sentinel(mode="fast")  # type: ignore[arg-type]


def test_sentinel_false_turns_it_off() -> None:
    model = Net()
    sink = MemorySink()
    _attach(model, sink, sentinel=False)
    observer = observer_of(model)
    assert observer is not None
    assert "sentinel" not in observer.run.settings
    model.shift = -100.0
    model(torch.rand(2, 4)).sum().backward()
    ti_core.remove_observer(model)
    assert _events(sink) == []


class BufferNet(nn.Module):
    """inp -> |.| + shift -> log -> out, ``shift`` a buffer (changing it recompiles nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.log = Log()
        self.out = nn.Linear(8, 1)
        self.register_buffer("shift", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.log(self.inp(x).abs() + self.shift))


def test_compiled_model_detects_at_the_root_and_replays_eagerly_without_recompiling() -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = BufferNet()
    compiled = torch.compile(model, fullgraph=True)
    sink = MemorySink()
    _attach(compiled, sink)
    data = torch.Generator().manual_seed(3)
    graphs = 0
    for step in range(6):
        if step == 2:  # forward 0 (sampled) and 1 (not) compiled their graphs
            graphs = counters["stats"]["unique_graphs"]
        if step == 3:
            model.shift.fill_(-100.0)
        if step == 5:
            model.shift.fill_(1.0)
        compiled.zero_grad()
        compiled(torch.rand(6, 4, generator=data) + 0.1).sum().backward()
    assert graphs > 0
    assert counters["stats"]["unique_graphs"] == graphs  # the replay compiled nothing
    ti_core.remove_observer(compiled)
    (event,) = _events(sink)
    assert (event["replay"], event["layer"], event["forward_index"]) == ("reproduced", "log", 3)
    assert float(model.shift) == 1.0


# ----------------------------------------------------------------------------- the checks


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
)
@pytest.mark.parametrize("numel", [1, 7, 4096, 1 << 15, (1 << 20) + 3])
def test_one_check_of_many_tensors_is_exact_against_numpy(dtype: torch.dtype, numel: int) -> None:
    """``check_all`` (one total of plain CPU tensors, Flags for the rest) and the fused norms
    an accelerator's tensors get (``Flags.add_norms``, run here on CPU tensors): each case is
    checked among finite companions whose sum (and norm) overflows, and must flag exactly the
    tensor numpy finds non-finite."""
    generator = torch.Generator().manual_seed(numel)
    base = torch.randn(numel, generator=generator, dtype=torch.float64)
    finfo = torch.finfo(dtype if not dtype.is_complex else torch.float32)
    base[0] = finfo.max  # finite extremes: a plain total or a norm overflows on them
    tensor = base.to(dtype)
    companion = torch.full((5,), finfo.max, dtype=dtype)
    cases = [tensor]
    for position in sorted({0, numel // 2, numel - 1}):
        for bad in (math.nan, math.inf, -math.inf):
            broken = tensor.clone()
            broken[position] = bad
            cases += [broken, broken[position % 2 :: 2]]  # the second is not contiguous
    for case in cases:
        wide = case.to(torch.complex128 if dtype.is_complex else torch.float64).numpy()
        expected = [] if np.isfinite(wide).all() else [(1, "case")]
        entries = [(0, "companion", companion), (1, "case", case), (2, "tail", companion)]
        assert check_all(entries) == expected, (dtype, numel)
        fused = Flags()
        fused.add_norms(entries)
        assert fused.read() == expected, (dtype, numel)
