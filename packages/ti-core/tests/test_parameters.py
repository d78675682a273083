"""The opt-in parameter signals against an independent float64 reference.

The reference takes its own copies: each parameter before the forward it is used in, its
``.grad`` after the backward, and its value before and after ``optimizer.step()`` (``after -
before`` in float64). The model holds a Linear, a Conv2d, a LayerNorm and an Embedding. Every
sampled forward is compared with the reference of *its own* step, and the neighbouring steps'
references differ from it, so a pairing off by one step fails.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from _core_helpers import METRICS, assert_matches, reference, rows, stats
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    MemorySink,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_core.capture.parameter_gradients import (
    GRADIENT_NONE_REASON,
    GRADIENT_REENTRANT_REASON,
)
from ti_core.capture.updates import NO_OPTIMIZER_REASON, REMOVED_REASON
from ti_schema import (
    DEFAULT_SIGNALS,
    PARAMETER_SIGNALS,
    validate_histograms,
    validate_history,
)

PARAMS = (
    ("embed", "weight"),
    ("conv", "weight"),
    ("conv", "bias"),
    ("norm", "weight"),
    ("norm", "bias"),
    ("head", "weight"),
    ("head", "bias"),
)


class Net(nn.Module):
    """Embedding -> Conv2d -> LayerNorm -> Linear: the four module kinds the issue names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.act = nn.ReLU()
        self.norm = nn.LayerNorm(96)
        self.head = nn.Linear(96, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        image = self.embed(tokens).unsqueeze(1)  # (B, 1, 4, 8)
        features = self.act(self.conv(image)).flatten(1)  # (B, 96)
        return self.head(self.norm(features))


def batches(steps: int, micro: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(7)
    return [
        [
            (torch.randint(0, 12, (6, 4), generator=gen), torch.randn(6, 2, generator=gen))
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


def snapshot(model: nn.Module) -> dict[tuple[str, str], np.ndarray]:
    return {
        (m, p): getattr(getattr(model, m), p).detach().double().numpy().copy() for m, p in PARAMS
    }


def grads(model: nn.Module) -> dict[tuple[str, str], np.ndarray]:
    return {
        (m, p): getattr(getattr(model, m), p).grad.detach().double().numpy().copy()
        for m, p in PARAMS
    }


Optimizers = Callable[[nn.Module], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optimizers] = {
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
}


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[list[tuple[torch.Tensor, torch.Tensor]]],
    *,
    set_to_none: bool = True,
) -> list[dict[str, Any]]:
    """Train with ``len(data[k])`` micro-batches per step; the reference of every root forward:
    the values it used, ``.grad`` after its backward, and its step's update (float64)."""
    forwards: list[dict[str, Any]] = []
    for micro in data:
        optimizer.zero_grad(set_to_none=set_to_none)
        step_forwards = []
        for tokens, target in micro:
            used = snapshot(model)
            loss = nn.functional.mse_loss(model(tokens), target)
            loss.backward()  # type: ignore[no-untyped-call]
            step_forwards.append({"value": used, "grad": grads(model)})
        before = snapshot(model)
        optimizer.step()
        after = snapshot(model)
        update = {k: after[k] - before[k] for k in before}
        for forward in step_forwards:
            forward["update"] = update
        forwards.extend(step_forwards)
    return forwards


ALL = (*DEFAULT_SIGNALS, *PARAMETER_SIGNALS)  # optimizer_state: test_optimizer_state.py


def observed_run(
    optimizer: str, *, sampler: Any, micro: int = 1, steps: int = 5, set_to_none: bool = True
) -> tuple[pa.Table, list[dict[str, Any]]]:
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[optimizer](model)
    sink = MemorySink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=sampler, signals=ALL, error_policy="raise"
    )
    try:
        forwards = train(model, opt, batches(steps, micro), set_to_none=set_to_none)
    finally:
        remove_observer(model)
    return sink.table(), forwards


def check_against_reference(table: pa.Table, forwards: list[dict[str, Any]]) -> int:
    """Every parameter row equals the reference of its own forward; returns samples checked."""
    validate_history(table)
    measured: dict[tuple[int, str, str, str], dict[str, float | None]] = {}
    samples: set[tuple[int, int]] = set()
    for r in table.to_pylist():
        samples.add((r["sample_id"], r["forward_index"]))
        key = (r["sample_id"], r["signal"], r["layer"], r["tensor_path"])
        measured.setdefault(key, {})[r["metric"]] = r["value"]
    assert samples
    for sample_id, forward_index in sorted(samples):
        ref = forwards[forward_index]
        for signal, part in (
            ("parameter", "value"),
            ("parameter_gradient", "grad"),
            ("parameter_update", "update"),
        ):
            for module, name in PARAMS:
                got = measured[(sample_id, signal, module, name)]
                assert set(got) == set(METRICS)
                assert_matches(got, reference(ref[part][(module, name)]))
    return len(samples)


def distinct(a: np.ndarray, b: np.ndarray) -> bool:
    return not np.allclose(a, b, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_other_step_matches_its_own_reference(optimizer: str) -> None:
    table, forwards = observed_run(optimizer, sampler=EveryNForwardsSampler(2), steps=6)
    assert check_against_reference(table, forwards) == 3
    assert sorted({r["forward_index"] for r in table.to_pylist()}) == [0, 2, 4]
    # The pairing is tested, not assumed: neighbouring steps' updates and gradients differ.
    for k in (1, 2, 3, 4):
        for key in ("update", "grad", "value"):
            assert distinct(
                forwards[k][key][("head", "weight")], forwards[k - 1][key][("head", "weight")]
            )


@pytest.mark.parametrize("set_to_none", [True, False])
def test_two_micro_batch_accumulation(set_to_none: bool) -> None:
    """Each micro-batch's forward is a sample: its gradient is .grad after its own backward, so
    the first holds micro-batch 0's gradient and the second the sum of both; both pair with the
    one step that follows, whether zero_grad sets .grad to None or to zeros."""
    table, forwards = observed_run(
        "sgd-momentum", sampler=AlwaysSampler(), micro=2, steps=3, set_to_none=set_to_none
    )
    assert check_against_reference(table, forwards) == 6
    first, second = forwards[2], forwards[3]  # step 1's two micro-batches
    key = ("conv", "weight")
    assert np.array_equal(first["update"][key], second["update"][key])
    assert distinct(first["grad"][key], second["grad"][key])
    assert np.array_equal(first["value"][key], second["value"][key])  # no step in between


def test_embedding_rows_not_looked_up_have_zero_gradient() -> None:
    """The embedding's gradient is dense: rows the batch did not use are zeros, and
    zero_fraction counts them (a check that the tensor measured is .grad, not the output)."""
    model = Net()
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        signals=("parameter_gradient",),
    )
    tokens = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])  # rows 4..11 unused
    model(tokens).sum().backward()  # type: ignore[no-untyped-call]
    remove_observer(model)
    got = stats(sink.table(), signal="parameter_gradient", layer="embed")
    assert got["zero_fraction"] == pytest.approx(8 / 12)
    assert_matches(got, reference(model.embed.weight.grad.double().numpy()))


def test_parameter_rows_identity() -> None:
    table, _ = observed_run("sgd-momentum", sampler=EveryNForwardsSampler(3), steps=4)
    found = [r for r in table.to_pylist() if r["signal"] in PARAMETER_SIGNALS]
    assert {(r["layer"], r["tensor_path"]) for r in found} == set(PARAMS)
    assert {r["call_index"] for r in found} == {0}
    assert {r["mode"] for r in found} == {"train"}
    assert {r["grad_enabled"] for r in found} == {True}
    assert {r["module_type"] for r in found if r["layer"] == "norm"} == {"LayerNorm"}
    shapes = {(r["layer"], r["tensor_path"], tuple(r["shape"])) for r in found}
    assert ("conv", "weight", (3, 1, 3, 3)) in shapes
    assert ("embed", "weight", (12, 8)) in shapes
    # values and gradients in the parameter's dtype; updates exact, in float64
    assert {(r["signal"], r["dtype"]) for r in found} == {
        ("parameter", "float32"),
        ("parameter_gradient", "float32"),
        ("parameter_update", "float64"),
    }
    # sample ids and forward indices of the forward the rows belong to
    assert {(r["sample_id"], r["forward_index"]) for r in found} == {(0, 0), (1, 3)}
    # per tensor and sample, the nine metrics once
    keys = [(r["sample_id"], r["signal"], r["layer"], r["tensor_path"], r["metric"]) for r in found]
    assert len(keys) == len(set(keys)) == 2 * 3 * len(PARAMS) * len(METRICS)


def test_default_signals_record_no_parameter_and_install_no_optimizer_hook() -> None:
    model = Net()
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    observer = observer_of(model)
    assert observer is not None
    assert observer.parameters is None
    assert observer.signals == {"output", "output_gradient"}
    assert sink.run is not None
    assert sink.run.settings["signals"] == "output,output_gradient"
    pre, post = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for micro in batches(2):
        tokens, target = micro[0]
        nn.functional.mse_loss(model(tokens), target).backward()  # type: ignore[no-untyped-call]
        assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (pre, post)
        opt.step()
    remove_observer(model)
    assert {r["signal"] for r in sink.table().to_pylist()} == {"output", "output_gradient"}


def _output_rows(signals: tuple[str, ...]) -> dict[tuple[Any, ...], Any]:
    """Rows of three sampled steps of a model whose Identity returns its (grad-requiring)
    input: a leaf output, whose gradient is hooked on the leaf itself."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Linear(4, 3), nn.Tanh())
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler(), signals=signals)
    try:
        for _ in range(3):
            x = torch.randn(5, 4, requires_grad=True)
            model(x).square().mean().backward()  # type: ignore[no-untyped-call]
    finally:
        remove_observer(model)
    return {
        (r["sample_id"], r["signal"], r["layer"], r["call_index"], r["tensor_path"], r["metric"]): (
            r["value"],
            r["shape"],
            r["unavailable_reason"],
        )
        for r in sink.table().to_pylist()
    }


@pytest.mark.parametrize("signal", ["output", "output_gradient"])
def test_one_output_signal_alone_gives_exactly_its_rows_of_the_default_pair(signal: str) -> None:
    """``signals=("output_gradient",)`` still derives the gradients' rows (the leaf output's
    included) from the forward's outputs without writing those; ``("output",)`` hooks no
    gradient."""
    both = _output_rows(("output", "output_gradient"))
    leaf = [v for k, v in both.items() if k[1] == "output_gradient" and k[2] == "0"]
    assert leaf
    assert all(v[0] is not None for v in leaf)
    alone = _output_rows((signal,))
    assert alone
    assert alone == {k: v for k, v in both.items() if k[1] == signal}


def _parameter_hooks(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_unsampled_steps_carry_no_parameter_hook() -> None:
    """Between samples nothing of the parameter signals is installed: no post-accumulate-grad
    hook on any parameter, no global optimizer step hook."""
    pre, post = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(4), signals=ALL
    )
    observer = observer_of(model)
    assert observer is not None
    seen = []
    for step, micro in enumerate(batches(8)):
        tokens, target = micro[0]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(tokens), target)
        during_forward = _parameter_hooks(model)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        installed = len(_global_optimizer_pre_hooks) - pre
        seen.append((step, during_forward, _parameter_hooks(model), installed))
    remove_observer(model)
    # sampled steps 0 and 4: hooks on the 7 parameters until their backward ended; the
    # optimizer hooks live from the sampled forward to the next root forward
    assert seen == [
        (0, 7, 0, 1),
        (1, 0, 0, 0),
        (2, 0, 0, 0),
        (3, 0, 0, 0),
        (4, 7, 0, 1),
        (5, 0, 0, 0),
        (6, 0, 0, 0),
        (7, 0, 0, 0),
    ]
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (pre, post)
    assert _parameter_hooks(model) == 0


def test_training_is_unchanged_by_every_signal() -> None:
    def run(observe: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        if observe:
            inject_observer(
                model, output_dir=None, sink=MemorySink(), sampler=AlwaysSampler(), signals=ALL
            )
        losses = []
        for micro in batches(4):
            tokens, target = micro[0]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(tokens), target)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            losses.append(float(loss.detach()))
        if observe:
            remove_observer(model)
        return losses, model.state_dict()

    bare_losses, bare_state = run(False)
    losses, state = run(True)
    assert losses == bare_losses
    assert all(torch.equal(state[k], bare_state[k]) for k in bare_state)


def test_histograms_cover_the_parameter_signals_of_focus_layers() -> None:
    model = Net()
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        signals=("parameter", "parameter_update"),
        histogram_selector=["head"],
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, target = batches(1)[0][0]
    before = model.head.weight.detach().double().numpy().copy()
    nn.functional.mse_loss(model(tokens), target).backward()  # type: ignore[no-untyped-call]
    opt.step()
    delta = model.head.weight.detach().double().numpy() - before
    remove_observer(model)
    histograms = sink.histograms()
    validate_histograms(histograms)
    found = {(r["signal"], r["layer"], r["tensor_path"]) for r in histograms.to_pylist()}
    assert found == {
        ("parameter", "head", "weight"),
        ("parameter", "head", "bias"),
        ("parameter_update", "head", "weight"),
        ("parameter_update", "head", "bias"),
    }
    row = rows(histograms, signal="parameter_update", tensor_path="weight")[0]
    assert row["num"] == delta.size
    assert row["sum"] == pytest.approx(delta.sum(), rel=1e-5, abs=1e-9)
    assert row["min"] == pytest.approx(delta.min(), rel=1e-6)
    assert sum(row["bucket_counts"]) == delta.size
    # only the chosen signals: no output rows at all
    assert {r["signal"] for r in sink.table().to_pylist()} == {"parameter", "parameter_update"}


@pytest.mark.parametrize(
    ("signals", "error", "match"),
    [
        (("output", "weights"), ValueError, r"unknown signal\(s\) \['weights'\]; choose from"),
        ("parameter", TypeError, "must be a collection of signal names"),
        ((), ValueError, "signals= is empty"),
        (7, TypeError, "must be a collection of signal names"),
    ],
)
def test_bad_signals_are_refused_before_anything_is_touched(
    signals: Any, error: type[Exception], match: str
) -> None:
    model = Net()

    class Refuses(MemorySink):
        def open(self, run: Any) -> None:  # pragma: no cover - must not be reached
            raise AssertionError("the sink was opened")

    with pytest.raises(error, match=match):
        inject_observer(model, output_dir=None, sink=Refuses(), signals=signals)
    assert observer_of(model) is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize(("budget", "match"), [(-1, "must be >= 0"), (1.5, "must be an int")])
def test_bad_budget_is_refused(budget: Any, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        inject_observer(
            Net(), output_dir=None, sink=MemorySink(), update_budget_bytes=budget, signals=ALL
        )


def _one_step(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    tokens: torch.Tensor,
    target: torch.Tensor,
) -> None:
    for opt in optimizers:
        opt.zero_grad()
    nn.functional.mse_loss(model(tokens), target).backward()  # type: ignore[no-untyped-call]
    for opt in optimizers:
        opt.step()


def test_several_optimizers_and_a_parameter_no_optimizer_holds() -> None:
    model = Net()
    trunk = torch.optim.SGD([*model.embed.parameters(), *model.conv.parameters()], lr=0.1)
    head = torch.optim.Adam(model.head.parameters(), lr=0.01)  # the LayerNorm: no optimizer
    sink = MemorySink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), signals=("parameter_update",)
    )
    data = batches(2)
    expected = []
    for micro in data:
        before = snapshot(model)
        _one_step(model, [trunk, head], *micro[0])
        after = snapshot(model)
        expected.append({k: after[k] - before[k] for k in before})
    remove_observer(model)
    table = sink.table()
    validate_history(table)
    for sample_id in (0, 1):
        for module, name in PARAMS:
            got = stats(table, sample_id=sample_id, layer=module, tensor_path=name)
            if module == "norm":
                assert set(got.values()) == {None}
                reasons = {
                    r["unavailable_reason"]
                    for r in rows(table, sample_id=sample_id, layer=module, tensor_path=name)
                }
                assert reasons == {NO_OPTIMIZER_REASON}
            else:
                assert_matches(got, reference(expected[sample_id][(module, name)]))


def test_update_budget_leaves_explicit_unavailable_rows() -> None:
    """The copies before a step stay within update_budget_bytes, taken in order while they fit:
    embed.weight (384 bytes), the conv's (108 + 12) and head.bias (8) fit in 512; the
    LayerNorm's (384 each) and head.weight (768) do not, and their rows name the budget."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        signals=("parameter_update",),
        update_budget_bytes=512,
    )
    assert sink.run is not None
    assert sink.run.settings["update_budget_bytes"] == "512"
    _one_step(model, [opt], *batches(1)[0][0])
    remove_observer(model)
    table = sink.table()
    measured = {(r["layer"], r["tensor_path"]) for r in table.to_pylist() if r["value"] is not None}
    assert measured == {("embed", "weight"), ("conv", "weight"), ("conv", "bias"), ("head", "bias")}
    missing = [r for r in table.to_pylist() if r["value"] is None]
    assert {(r["layer"], r["tensor_path"]) for r in missing} == set(PARAMS) - measured
    assert all("update_budget_bytes=512" in r["unavailable_reason"] for r in missing)
    assert all(
        "raise inject_observer(update_budget_bytes=" in r["unavailable_reason"] for r in missing
    )


def test_a_step_with_a_closure_pairs_with_the_forward_it_runs() -> None:
    """optimizer.step(closure) runs the forward inside the step (LBFGS, Lightning): the update
    measured is that step's, not the next one's."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=EveryNForwardsSampler(2),
        signals=("parameter_update",),
    )
    updates = []
    for micro in batches(4):
        tokens, target = micro[0]

        def closure(tokens: torch.Tensor = tokens, target: torch.Tensor = target) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(tokens), target)
            loss.backward()  # type: ignore[no-untyped-call]
            return loss

        before = snapshot(model)
        opt.step(closure)
        after = snapshot(model)
        updates.append({k: after[k] - before[k] for k in before})
    remove_observer(model)
    table = sink.table()
    for sample_id, step in ((0, 0), (1, 2)):
        for module, name in PARAMS:
            got = stats(table, sample_id=sample_id, layer=module, tensor_path=name)
            assert_matches(got, reference(updates[step][(module, name)]))
    assert distinct(updates[0][("head", "weight")], updates[1][("head", "weight")])


def test_removal_before_any_step_gives_unavailable_update_rows() -> None:
    model = Net()
    sink = MemorySink()
    inject_observer(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), signals=("parameter_update",)
    )
    tokens, _ = batches(1)[0][0]
    model(tokens)
    remove_observer(model)
    table = sink.table()
    assert {r["unavailable_reason"] for r in table.to_pylist()} == {REMOVED_REASON}
    assert {(r["layer"], r["tensor_path"]) for r in table.to_pylist()} == set(PARAMS)
    validate_history(table)


class Tied(nn.Module):
    """A language-model-style tie: the output layer reuses the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens))


def test_a_shared_parameter_is_measured_once_under_its_first_owner() -> None:
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler(), signals=ALL)
    tokens = torch.randint(0, 10, (3, 5))
    before = model.embed.weight.detach().double().numpy().copy()
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()  # type: ignore[no-untyped-call]
    grad = model.embed.weight.grad.double().numpy().copy()  # both uses, summed
    opt.step()
    delta = model.embed.weight.detach().double().numpy() - before
    remove_observer(model)
    table = sink.table()
    parameter_rows = [r for r in table.to_pylist() if r["signal"] in PARAMETER_SIGNALS]
    assert {(r["layer"], r["tensor_path"]) for r in parameter_rows} == {("embed", "weight")}
    assert_matches(stats(table, signal="parameter"), reference(before))
    assert_matches(stats(table, signal="parameter_gradient"), reference(grad))
    assert_matches(stats(table, signal="parameter_update"), reference(delta))


def test_frozen_parameters_have_values_and_updates_but_no_gradient_rows() -> None:
    model = Net()
    model.norm.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler(), signals=ALL)
    _one_step(model, [opt], *batches(1)[0][0])
    remove_observer(model)
    table = sink.table()
    norm = {r["signal"] for r in rows(table, layer="norm")}
    assert norm == {"output", "output_gradient", "parameter", "parameter_update"}
    # the optimizer holds it but skips it (no .grad): the update is measured, exactly zero
    assert (
        stats(table, layer="norm", tensor_path="weight", signal="parameter_update")["zero_fraction"]
        == 1.0
    )


def test_forward_without_backward_never_takes_a_later_backward_gradient() -> None:
    """An evaluation forward run with grad enabled and never backwarded is sampled; the next
    training step's backward must not be attributed to it, and its hooks go with its graph."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=EveryNForwardsSampler(2),
        signals=("parameter_gradient",),
    )
    data = batches(2)
    kept = model(data[0][0][0])  # forward 0, sampled; its graph is kept, never backwarded
    assert _parameter_hooks(model) == 7
    opt.zero_grad()
    model(data[0][0][0]).sum().backward()  # forward 1: unsampled; the backward is not sample 0's
    _one_step(model, [opt], *data[1][0])  # forward 2: sampled, with its own backward
    assert _parameter_hooks(model) == 7  # sample 0's hooks still wait on its live graph
    del kept
    gc.collect()
    assert _parameter_hooks(model) == 0
    remove_observer(model)
    sampled = {r["sample_id"] for r in sink.table().to_pylist()}
    assert sampled == {1}


def test_reentrant_checkpoint_and_consumed_gradients_are_explained() -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.out = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)
            return self.out(hidden)

    model = Checkpointed()
    consumed = []

    def optimizer_in_backward(param: torch.Tensor) -> None:  # uses the gradient and frees it
        consumed.append(param.grad)
        param.grad = None

    model.out.weight.register_post_accumulate_grad_hook(optimizer_in_backward)
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        signals=("parameter_gradient",),
    )
    x = torch.randn(4, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own reentrant-checkpoint notices
        model(x).sum().backward()  # type: ignore[no-untyped-call]
    remove_observer(model)
    table = sink.table()
    validate_history(table)
    reasons = {
        (r["layer"], r["tensor_path"]): r["unavailable_reason"]
        for r in table.to_pylist()
        if r["value"] is None
    }
    assert reasons == {
        ("inner", "weight"): GRADIENT_REENTRANT_REASON,
        ("inner", "bias"): GRADIENT_REENTRANT_REASON,
        ("out", "weight"): GRADIENT_NONE_REASON,
    }
    assert consumed
    assert_matches(
        stats(table, layer="out", tensor_path="bias", signal="parameter_gradient"),
        reference(model.out.bias.grad.double().numpy()),
    )
