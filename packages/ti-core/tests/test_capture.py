"""Forward capture: values taken at the module boundary, tensor paths, context, removal."""

from __future__ import annotations

import functools
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from _core_helpers import assert_matches, hook_state, reference, rows, stats
from torch import nn

from ti_core import AlwaysSampler, MemorySink, inject_observer, observe, remove_observer
from ti_schema import DEFAULT_METRICS
from ti_schema.testing import assert_history_conforms


def identity_linear(n: int) -> nn.Linear:
    lin = nn.Linear(n, n)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(n))
        lin.bias.zero_()
    return lin


def symmetric_inputs(rows_: int, cols: int) -> torch.Tensor:
    half = torch.rand(rows_ * cols // 2) * 2 - 1
    assert bool((half != 0).all())
    return torch.cat([half, -half]).reshape(rows_, cols)


def test_identity_linear_then_inplace_relu() -> None:
    model = nn.Sequential(identity_linear(8), nn.ReLU(inplace=True))
    x = symmetric_inputs(16, 8)
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        out = model(x)
        out.sum().backward()
    table = sink.table()
    assert_history_conforms(table)
    xs = x.numpy().astype(np.float64)

    linear_out = stats(table, layer="0", signal="output")
    assert linear_out["mean"] == pytest.approx(0.0, abs=1e-9)  # before the in-place ReLU
    assert_matches(linear_out, reference(xs))
    assert_matches(stats(table, layer="1", signal="output"), reference(np.maximum(xs, 0)))

    linear_grad = stats(table, layer="0", signal="output_gradient")
    assert linear_grad["mean"] == 0.5
    assert_matches(linear_grad, reference((xs > 0).astype(np.float64)))
    assert_matches(stats(table, layer="1", signal="output_gradient"), reference(np.ones_like(xs)))


def test_rows_carry_identity_and_context() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    run_id = sink.run.run_id if sink.run else ""
    model(torch.randn(5, 3))
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 3))
    remove_observer(model)
    table = sink.table()
    assert_history_conforms(table)
    first = rows(table, sample_id=0, layer="0", metric="mean")[0]
    assert first["run_id"] == run_id
    assert len(run_id) == 32
    assert first["module_type"] == "Linear"
    assert first["mode"] == "train"
    assert first["grad_enabled"] is True
    assert first["shape"] == [5, 4]
    assert first["dtype"] == "float32"
    assert first["tensor_path"] == ""
    assert first["call_index"] == 0
    assert first["rank"] == 0
    second = rows(table, sample_id=1, layer="1", metric="mean")[0]
    assert second["mode"] == "eval"
    assert second["grad_enabled"] is False
    assert second["forward_index"] == 1
    assert second["shape"] == [2, 4]
    # no_grad forward: no gradient rows at all
    assert not rows(table, sample_id=1, signal="output_gradient")
    assert sorted({r["metric"] for r in rows(table, sample_id=0, layer="0")}) == sorted(
        ["mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction"]
    )


def test_mode_is_the_module_own_flag() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model[1].eval()  # the parent stays in train mode
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        model(torch.randn(4, 2))
    table = sink.table()
    assert {r["mode"] for r in rows(table, layer="0")} == {"train"}
    assert {r["mode"] for r in rows(table, layer="1")} == {"eval"}


Pair = namedtuple("Pair", ["left", "right", "note"])


@dataclass
class Result:
    hidden: torch.Tensor
    label: str
    extra: Any


class TreeOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return (
            x + 1,
            [x * 2, "text", None, 3],
            {"logits": x * 3, "nested": {"inner": x * 4}, 7: x * 5},
            Result(hidden=x * 6, label="s", extra=(x * 7, 1.5)),
            Pair(x * 8, x.long(), "n"),
        )


def test_pytree_tensor_paths_skip_non_tensor_leaves() -> None:
    model = nn.Sequential(TreeOutput())
    sink = MemorySink()
    x = torch.randn(3, 2)
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        model(x)
    table = sink.table()
    assert_history_conforms(table)
    expected = {
        "[0]": x + 1,
        "[1][0]": x * 2,
        "[2]['logits']": x * 3,
        "[2]['nested']['inner']": x * 4,
        "[2][7]": x * 5,
        "[3].hidden": x * 6,
        "[3].extra[0]": x * 7,
        "[4].left": x * 8,
        "[4].right": x.long(),
    }
    got_paths = [r["tensor_path"] for r in rows(table, signal="output", metric="mean")]
    assert got_paths == list(expected)
    for path, tensor in expected.items():
        assert_matches(stats(table, signal="output", tensor_path=path), reference(tensor.numpy()))
    assert rows(table, tensor_path="[4].right", metric="mean")[0]["dtype"] == "int64"


def test_empty_nan_and_inf_tensors_have_reasons() -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            inf = x.clone()
            inf[0, 0] = float("inf")
            inf[1, 1] = float("-inf")
            inf[2, 0] = float("nan")
            return x[:0], torch.full_like(x, float("nan")), inf

    sink = MemorySink()
    model = nn.Sequential(Odd())
    x = torch.randn(4, 3)
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        model(x)
    table = sink.table()
    assert_history_conforms(table)
    empty = rows(table, tensor_path="[0]")
    assert len(empty) == len(DEFAULT_METRICS)
    assert all(r["value"] is None for r in empty)
    assert all("empty" in r["unavailable_reason"] for r in empty)
    assert empty[0]["shape"] == [0, 3]

    nan = {r["metric"]: r for r in rows(table, tensor_path="[1]")}
    assert nan["nonfinite_fraction"]["value"] == 1.0
    assert nan["zero_fraction"]["value"] == 0.0
    for metric in ("mean", "std", "min", "max", "p25", "p50", "p75"):
        assert nan[metric]["value"] is None
        assert "finite" in nan[metric]["unavailable_reason"]

    inf = x.clone().numpy().astype(np.float64)
    inf[0, 0], inf[1, 1], inf[2, 0] = np.inf, -np.inf, np.nan
    got = stats(table, tensor_path="[2]")
    assert_matches(got, reference(inf))
    assert got["nonfinite_fraction"] == pytest.approx(3 / 12)
    for r in rows(table):
        assert (r["value"] is None) == (r["unavailable_reason"] is not None)


class Recursive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        y = self.lin(x)
        return self(y, depth - 1) if depth else y


def test_nested_root_calls_are_one_root_forward() -> None:
    model = Recursive()
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        model(torch.randn(1, 2))
        model(torch.randn(1, 2))
    table = sink.table()
    assert sorted({(r["sample_id"], r["forward_index"]) for r in rows(table)}) == [(0, 0), (1, 1)]
    assert sorted({r["call_index"] for r in rows(table, sample_id=0, layer="lin")}) == [0, 1, 2]


def test_root_module_selected_and_aliases() -> None:
    shared = nn.Linear(2, 2)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = shared
            self.decoder = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decoder(self.encoder(x))

    model = Tied()
    sink = MemorySink()
    with observe(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), selector=lambda n, m: True
    ):
        model(torch.randn(3, 2))
    run = sink.run
    assert run is not None
    assert [(info.name, info.aliases) for info in run.layers] == [
        ("", ()),
        ("encoder", ("decoder",)),
    ]
    table = sink.table()
    assert {r["layer"] for r in table.to_pylist()} == {"", "encoder"}
    assert sorted({r["call_index"] for r in rows(table, layer="encoder", signal="output")}) == [
        0,
        1,
    ]
    assert rows(table, layer="", signal="output", metric="mean")[0]["module_type"] == "Tied"


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child.forward(x) + self.child(x * 2)


@pytest.mark.parametrize("direct", [False, True])
def test_direct_forward_capture_counts_each_call_once(direct: bool) -> None:
    model = Parent()
    before = hook_state(model)
    sink = MemorySink()
    x = torch.randn(2, 3)
    with observe(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), capture_direct_forwards=direct
    ):
        model(x)
        model(x).sum().backward()
    table = sink.table()
    calls = rows(table, sample_id=1, layer="child", signal="output", metric="mean")
    with torch.no_grad():
        direct_out = model.child(x).numpy()
        called_out = model.child(x * 2).numpy()
    if direct:
        assert [r["call_index"] for r in calls] == [0, 1]
        assert_matches(
            stats(table, sample_id=1, layer="child", call_index=0, signal="output"),
            reference(direct_out),
        )
        assert_matches(
            stats(table, sample_id=1, layer="child", call_index=1, signal="output"),
            reference(called_out),
        )
        assert (
            len(rows(table, sample_id=1, layer="child", signal="output_gradient", metric="mean"))
            == 2
        )
    else:
        assert [r["call_index"] for r in calls] == [0]
        assert_matches(
            stats(table, sample_id=1, layer="child", signal="output"), reference(called_out)
        )
    assert hook_state(model) == before
    assert "forward" not in model.child.__dict__


def test_direct_forward_override_restores_a_user_instance_forward() -> None:
    model = Parent()
    original = model.child.forward

    def doubled(x: torch.Tensor) -> torch.Tensor:
        return original(x) * 2

    user_forward = functools.partial(doubled)
    model.child.forward = user_forward  # type: ignore[method-assign]
    before = hook_state(model)
    sink = MemorySink()
    x = torch.randn(2, 3)
    with observe(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), capture_direct_forwards=True
    ):
        during = model(x)
        assert model.child.__dict__["forward"] is not user_forward  # overridden while sampling
    assert model.child.__dict__["forward"] is user_forward
    assert hook_state(model) == before
    with torch.no_grad():
        want = (model.child.forward(x) + model.child(x * 2)).numpy()
    np.testing.assert_array_equal(during.detach().numpy(), want)
    assert_matches(
        stats(sink.table(), layer="child", call_index=0, signal="output"),
        reference((original(x) * 2).detach().numpy()),
    )


class TwoLeaves(nn.Module):
    """Leaves called through ``__call__`` or, as code that bypasses hooks does, ``.forward``."""

    def __init__(self, direct_leaves: bool) -> None:
        super().__init__()
        self.direct_leaves = direct_leaves
        self.a = nn.Linear(3, 4)
        self.b = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.direct_leaves:
            return self.b.forward(self.a.forward(x))
        return self.b(self.a(x))


def _measured(table: Any) -> list[tuple[int, str, str, int, str]]:
    return sorted(
        (r["forward_index"], r["layer"], r["signal"], r["call_index"], r["metric"])
        for r in table.to_pylist()
        if r["value"] is not None
    )


@pytest.mark.parametrize("direct_root", [False, True], ids=["model(x)", "model.forward(x)"])
@pytest.mark.parametrize("direct_leaves", [False, True], ids=["leaf(x)", "leaf.forward(x)"])
def test_capture_direct_forwards_records_every_call_combination(
    direct_root: bool, direct_leaves: bool
) -> None:
    """The root called as ``model.forward(x)`` is a root forward too: sampled, counted once,
    its own output and its leaves' recorded, with their gradients."""
    torch.manual_seed(0)
    model = TwoLeaves(direct_leaves)
    before = hook_state(model)
    sink = MemorySink()
    xs = [torch.randn(2, 3) for _ in range(2)]
    with observe(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), capture_direct_forwards=True
    ):
        assert "forward" in model.__dict__
        for x in xs:
            out = model.forward(x) if direct_root else model(x)
            out.sum().backward()
    assert "forward" not in model.__dict__  # removal restores the class forward
    assert hook_state(model) == before
    table = sink.table()
    assert_history_conforms(table)
    measured = _measured(table)
    assert sorted({m[0] for m in measured}) == [0, 1]  # two root forwards, counted once each
    for forward_index, x in enumerate(xs):
        hidden = model.a(x)
        for layer, tensor in (("a", hidden), ("b", torch.tanh(hidden))):
            assert_matches(
                stats(table, forward_index=forward_index, layer=layer, signal="output"),
                reference(tensor.detach().numpy()),
            )
            assert stats(table, forward_index=forward_index, layer=layer, signal="output_gradient")
    # the same rows whichever way each module was called
    baseline = MemorySink()
    torch.manual_seed(0)
    plain = TwoLeaves(direct_leaves=False)
    with observe(plain, output_dir=None, sink=baseline, sampler=AlwaysSampler()):
        for x in xs:
            plain(x).sum().backward()
    assert measured == _measured(baseline.table())


class SelfCalling(nn.Module):
    """A root whose forward calls its own ``forward`` directly (nested, not a second root
    forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
        y: torch.Tensor = self.lin(x)
        return self.forward(y, depth - 1) if depth else y


@pytest.mark.parametrize("direct_root", [False, True])
def test_a_nested_direct_root_forward_is_not_counted_again(direct_root: bool) -> None:
    model = SelfCalling()
    sink = MemorySink()
    with observe(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        capture_direct_forwards=True,
        selector=lambda name, module: True,  # the root too
    ):
        x = torch.randn(2, 3)
        for _ in range(3):
            model.forward(x) if direct_root else model(x)
    table = sink.table()
    assert sorted(set(table.column("forward_index").to_pylist())) == [0, 1, 2]
    calls = rows(table, forward_index=0, layer="lin", signal="output", metric="mean")
    assert [r["call_index"] for r in calls] == [0, 1]
    root = rows(table, forward_index=0, layer="", signal="output", metric="mean")
    assert len(root) == 1  # the outer call's output only


def test_without_capture_direct_forwards_a_direct_root_forward_is_not_observed() -> None:
    model = TwoLeaves(direct_leaves=False)
    sink = MemorySink()
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        assert "forward" not in model.__dict__
        model.forward(torch.randn(2, 3))
    assert sink.table().num_rows == 0


def test_removal_leaves_no_hook_or_attribute() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
    before = hook_state(model)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = list(model.named_modules())
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    assert list(model.state_dict()) == list(state_before)
    assert list(model.named_modules()) == modules_before  # the observer is no submodule
    model(torch.randn(3, 2)).sum().backward()
    remove_observer(model)
    assert hook_state(model) == before
    assert sink.close_count == 1
    remove_observer(model)  # a no-op now
    assert sink.close_count == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, state_before[key])


def test_exception_in_sampled_forward_leaves_no_state() -> None:
    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if self.fail:
                raise RuntimeError("boom in forward")
            return y

    model = Flaky()
    before = hook_state(model)
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    with pytest.raises(RuntimeError, match="boom in forward"):
        model(torch.randn(1, 2))
    model.fail = False
    model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    assert hook_state(model) == before
    table = sink.table()
    assert sorted({r["sample_id"] for r in rows(table)}) == [0, 1]
    assert rows(table, sample_id=1, layer="lin", signal="output_gradient")
    assert not rows(table, sample_id=0, signal="output_gradient")


def test_memory_sink_without_records_is_an_empty_valid_table() -> None:
    sink = MemorySink()
    assert sink.table().num_rows == 0
    assert_history_conforms(sink.table())
    assert sink.histograms().num_rows == 0


def test_same_tensor_through_identity_chain_is_measured_for_every_call() -> None:
    class AddInPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.add_(1.0)

    model = nn.Sequential(
        nn.Linear(3, 3), nn.Identity(), nn.Identity(), AddInPlace(), nn.Identity()
    )
    sink = MemorySink()
    x = torch.randn(4, 3)
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        out = model(x)
        (out * torch.arange(3.0)).sum().backward()
    table = sink.table()
    with torch.no_grad():
        before = model[0](x).numpy()
    for layer in ("0", "1", "2"):
        assert_matches(stats(table, layer=layer, signal="output"), reference(before))
    for layer in ("3", "4"):
        assert_matches(stats(table, layer=layer, signal="output"), reference(before + 1))
    grad = np.broadcast_to(np.arange(3.0), (4, 3))
    for layer in ("0", "1", "2", "3", "4"):
        assert_matches(stats(table, layer=layer, signal="output_gradient"), reference(grad))


@pytest.mark.slow
def test_tensor_above_2_pow_24_has_exact_quartiles_end_to_end() -> None:
    # 2**24 + 1 float32 entries: 4 bytes over the snapshot budget, so reduced without a copy
    x = torch.randn(2**24 + 1)
    x[::1000] = 0.0
    sink = MemorySink()
    model = nn.Sequential(nn.Identity())
    with observe(
        model, output_dir=None, sink=sink, sampler=AlwaysSampler(), max_histogram_modules=0
    ):
        model(x)
    got = stats(sink.table(), layer="0", signal="output")
    a = x.numpy().astype(np.float64)
    for metric, q in (("p25", 25), ("p50", 50), ("p75", 75)):
        assert got[metric] == pytest.approx(float(np.percentile(a, q)), rel=1e-6, abs=1e-7)
    assert got["zero_fraction"] == pytest.approx(float(np.mean(a == 0)), rel=1e-12)
    assert got["mean"] == pytest.approx(float(a.mean()), rel=1e-5, abs=1e-7)


def test_keyboard_interrupt_in_a_forward_does_not_stop_sampling() -> None:
    class Interrupted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.interrupt = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if self.interrupt:
                raise KeyboardInterrupt  # skips torch's always-called forward hooks
            return y

    model = Interrupted()
    before = hook_state(model)
    sink = MemorySink()
    inject_observer(model, output_dir=None, sink=sink, sampler=AlwaysSampler())
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(1, 2))
    model.interrupt = False
    for _ in range(2):
        model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    assert hook_state(model) == before
    table = sink.table()
    assert sorted({(r["sample_id"], r["forward_index"]) for r in rows(table)}) == [(1, 1), (2, 2)]
    assert len(rows(table, layer="lin", signal="output_gradient", metric="mean")) == 2
