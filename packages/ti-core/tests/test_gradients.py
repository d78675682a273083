"""Output gradients: bound to their own sample and call, first backward recorded, no leaks."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import numpy as np
import pytest
import torch
from _core_helpers import assert_matches, reference, rows, stats
from torch import nn
from torch.utils.checkpoint import checkpoint

from ti_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    MemorySink,
    inject_observer,
    observe,
    remove_observer,
)
from ti_core.capture.gradients import LEAF_SHARED_REASON, GradientState
from ti_schema.testing import assert_history_conforms


def retained(tensor: torch.Tensor) -> torch.Tensor:
    tensor.retain_grad()
    return tensor


class Shared(nn.Module):
    """One Linear called twice; the reference run retains each call's output gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
        first = self.lin(x)
        if keep is not None:
            keep.append(retained(first))
        second = self.lin(torch.tanh(first))
        if keep is not None:
            keep.append(retained(second))
        return second


def test_shared_module_calls_have_their_own_gradients() -> None:
    model = Shared()
    x = torch.randn(3, 4, dtype=torch.float64)
    weights = torch.randn(3, 4, dtype=torch.float64)
    keep: list[torch.Tensor] = []
    (Shared.forward(copy.deepcopy(model), x, keep) * weights).sum().backward()
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        (model(x) * weights).sum().backward()
    table = sink.table()
    assert_history_conforms(table)
    for call, tensor in enumerate(keep):
        assert tensor.grad is not None
        got_out = stats(table, layer="lin", call_index=call, signal="output")
        got_grad = stats(table, layer="lin", call_index=call, signal="output_gradient")
        assert_matches(got_out, reference(tensor.detach().numpy()), rtol=1e-12)
        assert_matches(got_grad, reference(tensor.grad.numpy()), rtol=1e-12)
    assert not np.allclose(keep[0].grad.numpy(), keep[1].grad.numpy())


def test_outstanding_forwards_backpropagated_in_reverse_order() -> None:
    model = nn.Sequential(nn.Linear(4, 3, dtype=torch.float64), nn.Tanh())
    x1 = torch.randn(5, 4, dtype=torch.float64)
    x2 = torch.randn(5, 4, dtype=torch.float64)
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        y1 = model(x1)
        y2 = model(x2)
        (3.0 * y2.sum()).backward()
        (0.5 * (y1**2).sum()).backward()
    table = sink.table()
    y1n, y2n = y1.detach().numpy(), y2.detach().numpy()
    # d/dy of 0.5*y^2 is y; of 3*sum(y) is 3; through tanh multiply by 1 - y^2
    expected = {
        (0, "1"): y1n,
        (1, "1"): np.full_like(y2n, 3.0),
        (0, "0"): y1n * (1 - y1n**2),
        (1, "0"): 3.0 * (1 - y2n**2),
    }
    for (sample, layer), grad in expected.items():
        got = stats(table, sample_id=sample, layer=layer, signal="output_gradient")
        assert_matches(got, reference(grad), rtol=1e-12)
        row = rows(table, sample_id=sample, layer=layer, signal="output_gradient")[0]
        assert row["forward_index"] == sample
        assert row["mode"] == "train"
    # backward rows carry backward time: sample 1's gradients were seen before sample 0's
    t0 = rows(table, sample_id=0, layer="0", signal="output_gradient")[0]["timestamp"]
    t1 = rows(table, sample_id=1, layer="0", signal="output_gradient")[0]["timestamp"]
    assert t1 <= t0


def test_gradients_inherit_the_forward_context() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model.eval()
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        out = model(torch.randn(3, 2))
        model.train()
        out.sum().backward()
    grad_row = rows(sink.table(), signal="output_gradient", metric="mean")[0]
    assert grad_row["mode"] == "eval"
    assert grad_row["grad_enabled"] is True


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(3, 3)
        self.side = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.main(x)
        return h, self.side(h.detach())


def test_detached_branch_has_output_rows_but_no_gradient_rows() -> None:
    model = Branches()
    sink = MemorySink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
            main, _side = model(torch.randn(2, 3))
            main.sum().backward()
    table = sink.table()
    assert rows(table, layer="side", signal="output")
    assert not rows(table, layer="side", signal="output_gradient")
    assert_matches(stats(table, layer="main", signal="output_gradient"), reference(np.ones((2, 3))))


def test_first_backward_per_tensor_is_recorded() -> None:
    model = nn.Sequential(nn.Linear(2, 2, dtype=torch.float64))
    x = torch.randn(4, 2, dtype=torch.float64)
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        out = model(x)
        out.sum().backward(retain_graph=True)
        (5.0 * out.sum()).backward(retain_graph=True)
        (7.0 * out.sum()).backward()
    grads = rows(sink.table(), signal="output_gradient", metric="mean")
    assert len(grads) == 1
    assert grads[0]["value"] == 1.0


def test_integer_outputs_have_no_gradient_rows() -> None:
    class Argmax(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x.argmax(dim=1)

    model = nn.Sequential(nn.Linear(3, 3), Argmax())
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        values, _index = model(torch.randn(4, 3))
        values.sum().backward()
    table = sink.table()
    assert rows(table, layer="1", tensor_path="[1]", signal="output")
    assert not rows(table, layer="1", tensor_path="[1]", signal="output_gradient")
    assert rows(table, layer="1", tensor_path="[0]", signal="output_gradient")


def _live_gradient_states() -> int:
    gc.collect()
    return sum(type(o) is GradientState for o in gc.get_objects())


def test_forward_without_backward_leaks_nothing() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    baseline = _live_gradient_states()
    refs = []
    for _ in range(20):
        out = model(torch.randn(4, 8))
        refs.append(weakref.ref(out))
        del out  # never backpropagated
    # freed by reference counting alone: the observer created no reference cycle
    assert all(r() is None for r in refs)
    assert _live_gradient_states() == baseline
    remove_observer(model)
    assert len({r["sample_id"] for r in rows(sink.table())}) == 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.act = nn.GELU()
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


class Checkpointed(nn.Module):
    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(6, 6)
        self.block = Block()
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.mode is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.mode == "reentrant")
        return self.out(h)


def _run(model: nn.Module, x: torch.Tensor) -> list[dict[str, object]]:
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        for _ in range(2):
            model(x).pow(2).sum().backward()
    table = sink.table()
    assert_history_conforms(table)
    keys = (
        "sample_id",
        "layer",
        "call_index",
        "signal",
        "tensor_path",
        "mode",
        "grad_enabled",
        "metric",
    )
    return sorted(
        ({k: r[k] for k in (*keys, "value", "unavailable_reason")} for r in table.to_pylist()),
        key=lambda r: tuple(str(r[k]) for k in keys),
    )


def test_non_reentrant_checkpointing_equals_a_plain_run() -> None:
    plain = Checkpointed(None)
    checked = copy.deepcopy(plain)
    checked.mode = "non-reentrant"
    x = torch.randn(5, 6)
    expected = _run(plain, x)
    got = _run(checked, x)
    assert len(got) == len(expected)
    assert {r["layer"] for r in got} == {"inp", "block.a", "block.act", "block.b", "out"}
    for g, e in zip(got, expected, strict=True):
        assert {k: v for k, v in g.items() if k != "value"} == {
            k: v for k, v in e.items() if k != "value"
        }
        assert g["value"] == pytest.approx(e["value"], rel=1e-6, abs=1e-9)


def test_reentrant_checkpointing_records_a_gap_never_wrong_numbers() -> None:
    plain = Checkpointed(None)
    checked = copy.deepcopy(plain)
    checked.mode = "reentrant"
    x = torch.randn(5, 6)
    expected = {
        (r["sample_id"], r["layer"], r["call_index"], r["signal"], r["metric"]): r["value"]
        for r in _run(plain, x)
    }
    got = _run(checked, x)
    inner = {"block.a", "block.act", "block.b"}
    for r in got:
        key = (r["sample_id"], r["layer"], r["call_index"], r["signal"], r["metric"])
        if r["layer"] in inner and r["signal"] == "output_gradient":
            assert r["value"] is None
            assert "reentrant" in str(r["unavailable_reason"])
        else:
            assert r["value"] == pytest.approx(expected[key], rel=1e-6, abs=1e-9)
    gaps = {
        (r["sample_id"], r["layer"])
        for r in got
        if r["signal"] == "output_gradient" and r["layer"] in inner
    }
    assert gaps == {(s, layer) for s in (0, 1) for layer in inner}


def test_a_leaf_output_records_its_gradient_and_its_hook_goes() -> None:
    """nn.Identity on an input that requires grad returns that leaf: its gradient is the
    output gradient (0.8.0 recorded it too), histogram included; the hook on the leaf is
    removed after its backward."""
    model = nn.Sequential(nn.Identity(), nn.Linear(2, 2))
    x = torch.randn(3, 2, requires_grad=True)
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        model(x).pow(2).sum().backward()
        assert not x._backward_hooks  # answered: removed at once, not at removal
    table = sink.table()
    assert_history_conforms(table)
    assert x.grad is not None
    assert_matches(stats(table, layer="0", signal="output_gradient"), reference(x.grad.numpy()))
    histograms = sink.histograms().to_pylist()
    assert {(h["layer"], h["signal"]) for h in histograms} >= {("0", "output_gradient")}


class ReturnsItsParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(2))

    def forward(self) -> torch.Tensor:
        return self.bias


class WithLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.shift = ReturnsItsParameter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.shift()


def test_a_module_returning_its_parameter_records_that_steps_gradient() -> None:
    torch.manual_seed(0)
    model = WithLeaf()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    grads = []
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 2)).sum().backward()
            assert model.shift.bias.grad is not None
            grads.append(model.shift.bias.grad.clone())
            opt.step()
    assert not model.shift.bias._backward_hooks
    table = sink.table()
    for forward_index, grad in enumerate(grads):
        assert_matches(
            stats(table, forward_index=forward_index, layer="shift", signal="output_gradient"),
            reference(grad.numpy()),
        )


def test_a_leaf_shared_by_several_forwards_before_one_backward_is_an_honest_null() -> None:
    """Two forwards, one backward: the parameter's gradient sums both, so neither forward's
    row holds it; nor does a sampled forward's when an unsampled one ran before the backward."""
    torch.manual_seed(0)
    model = WithLeaf()
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        (model(torch.randn(4, 2)) + model(torch.randn(4, 2))).sum().backward()
    rows_ = rows(sink.table(), layer="shift", signal="output_gradient")
    assert {r["forward_index"] for r in rows_} == {0, 1}
    assert all(r["value"] is None for r in rows_)
    assert {r["unavailable_reason"] for r in rows_} == {LEAF_SHARED_REASON}
    assert_history_conforms(sink.table())
    assert not model.shift.bias._backward_hooks

    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=EveryNForwardsSampler(2)):
        (model(torch.randn(4, 2)) + model(torch.randn(4, 2))).sum().backward()
    rows_ = rows(sink.table(), layer="shift", signal="output_gradient")
    assert {r["forward_index"] for r in rows_} == {0}
    assert all(r["value"] is None for r in rows_)
    assert {r["unavailable_reason"] for r in rows_} == {LEAF_SHARED_REASON}
    lin = rows(sink.table(), layer="lin", signal="output_gradient")
    assert lin
    assert all(r["value"] is not None for r in lin)  # non-leaf outputs: exact


def test_a_leaf_hook_whose_backward_never_comes_is_removed_with_the_observer() -> None:
    model = WithLeaf()
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    for _ in range(3):  # forwards with grad enabled and no backward: one pending hook at most
        model(torch.randn(4, 2))
        assert len(model.shift.bias._backward_hooks) == 1
    remove_observer(model)
    assert not model.shift.bias._backward_hooks
