"""Capture inside ``torch.compile`` graphs: fullgraph inductor training records what eager records.

The eager reference is the same observer on an uncompiled copy of the same model, seed and
inputs. Code generation matters for the values (inductor reuses buffers, reorders kernels), so
the row comparisons compile with inductor (a real C++ build per graph, hence ``slow``; the
nox sessions share one on-disk inductor cache, ``TORCHINDUCTOR_CACHE_DIR``). What does not depend
on code generation (which operators a graph holds, graph breaks, lifetimes, binding) uses
cheaper backends, named per test.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import _compiled_models as models
import numpy as np
import pytest
import torch
import torch._dynamo
from torch import fx, nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import ti_core
from ti_core import AlwaysSampler, EveryNForwardsSampler, MemorySink
from ti_core import tensor_paths as paths
from ti_core.capture.gradients import GradientState
from ti_core.capture.sample import LEAF_REASON
from ti_core.capture.traced_calls import NESTED_REASON
from ti_core.compiled import operators
from ti_core.compiled.traced import CUDA_GRAPHS_REFUSED, traced_leaves
from ti_core.gate import GateState

pytestmark = pytest.mark.slow

STEPS = 4
IDENTITY = (
    "sample_id",
    "forward_index",
    "layer",
    "module_type",
    "call_index",
    "signal",
    "tensor_path",
    "mode",
    "grad_enabled",
    "shape",
    "dtype",
    "metric",
    "unavailable_reason",
)
HIST_IDENTITY = (*IDENTITY[:-2], "num", "nonfinite_count")
METRIC = IDENTITY.index("metric")

Rows = dict[tuple[Any, ...], float | None]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test starts and ends with Dynamo's caches and counters empty."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(shape: tuple[int, ...], n: int = STEPS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=gen) for _ in range(n)]


def _train(
    call: Callable[[torch.Tensor], Any], params: nn.Module, xs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Real SGD steps; the parameters after each."""
    opt = torch.optim.SGD(params.parameters(), lr=0.05)
    after = []
    for x in xs:
        opt.zero_grad()
        (call(x).float() ** 2).mean().backward()
        opt.step()
        after.append(torch.cat([p.detach().flatten().clone() for p in params.parameters()]))
    return after


def _rows(sink: MemorySink) -> Rows:
    """Every history row by its identity (shape as a tuple); each identity once."""
    out: Rows = {}
    for r in sink.table().to_pylist():
        key = tuple(tuple(r[c]) if c == "shape" else r[c] for c in IDENTITY)
        assert key not in out, f"duplicate row {key}"
        out[key] = r["value"]
    return out


def _histograms(sink: MemorySink) -> dict[tuple[Any, ...], tuple[np.ndarray, ...]]:
    out = {}
    for r in sink.histograms().to_pylist():
        key = tuple(tuple(r[c]) if c == "shape" else r[c] for c in HIST_IDENTITY)
        assert key not in out, f"duplicate histogram {key}"
        out[key] = (
            np.array(r["bucket_limits"]),
            np.array(r["bucket_counts"]),
            np.array([r["min"], r["max"], r["sum"], r["sum_squares"]]),
        )
    return out


def _assert_rows_equal(got: Rows, want: Rows, rtol: float = 1e-4) -> None:
    assert got.keys() == want.keys(), (
        f"missing {sorted(want.keys() - got.keys(), key=repr)[:3]}, "
        f"extra {sorted(got.keys() - want.keys(), key=repr)[:3]}"
    )
    # zero_fraction counts entries that are exactly zero, so it is not continuous in the
    # values: an entry that is zero in eager may be a rounding residue (~1e-9) in a fused
    # compiled kernel and the reverse (seen on an AVX-512 CPU: 8 to 16 of 1,536 entries of the
    # gradient into a causal attention's qkv projection, where the first token's softmax is
    # exactly 1). It is held to a few percent of the entries; every other metric to rtol.
    fractions = sorted((k for k in want if k[METRIC] == "zero_fraction"), key=repr)
    others = sorted((k for k in want if k[METRIC] != "zero_fraction"), key=repr)
    for keys, key_rtol, atol in ((fractions, 0.0, 1 / 32), (others, rtol, 1e-6)):
        assert keys, "vacuous check: no rows of this kind"
        g = np.array([np.nan if got[k] is None else got[k] for k in keys])
        w = np.array([np.nan if want[k] is None else want[k] for k in keys])
        np.testing.assert_allclose(g, w, rtol=key_rtol, atol=atol)


def _assert_histograms_equal(got: dict[Any, Any], want: dict[Any, Any]) -> None:
    assert got.keys() == want.keys()
    for key, (limits, counts, moments) in want.items():
        g_limits, g_counts, g_moments = got[key]
        np.testing.assert_allclose(g_limits, limits, rtol=1e-4, atol=1e-6, err_msg=str(key))
        # A value within float rounding of a bucket limit may land in the neighbouring bucket
        # (compiled kernels round differently from eager ones): the same total, and the
        # cumulative counts never further apart than a couple of such values.
        assert g_counts.sum() == counts.sum(), key
        drift = np.abs(np.cumsum(g_counts) - np.cumsum(counts)).max()
        assert drift <= 2, (key, g_counts, counts)
        # float32 rounding of sums grows with the element count (a LayerNorm output sums to ~0)
        atol = 1e-6 * max(1, key[HIST_IDENTITY.index("num")])
        np.testing.assert_allclose(g_moments, moments, rtol=1e-4, atol=atol, err_msg=str(key))


def _observe(model: nn.Module, sink: MemorySink, sampler: Any, **options: Any) -> None:
    ti_core.inject_observer(model, output_dir=None, sink=sink, sampler=sampler, **options)


def _eager(
    model: nn.Module, xs: list[torch.Tensor], sampler: Any, **options: Any
) -> tuple[Rows, Any, list[torch.Tensor]]:
    sink = MemorySink()
    _observe(model, sink, sampler, **options)
    try:
        params = _train(model, model, xs)
    finally:
        ti_core.remove_observer(model)
    return _rows(sink), _histograms(sink), params


ORDERS = ("compile-first", "inject-first", "module.compile", "sequential-root")


def _root(model: nn.Module, order: str) -> nn.Module:
    """sequential-root observes ``nn.Sequential(model)``: a root whose ``forward`` is PyTorch's
    own, so ``torch.compile`` traces the root's hooks into the graph (decided ahead)."""
    return nn.Sequential(model) if order == "sequential-root" else model


def _compile(
    model: nn.Module, order: str, backend: Any, sink: MemorySink, sampler: Any, **options: Any
) -> tuple[Any, nn.Module]:
    """Observe and compile ``model`` (already through :func:`_root`) in ``order``, with
    ``fullgraph=True``; return (what to call, what is observed)."""
    if order == "compile-first":
        target = torch.compile(model, backend=backend, fullgraph=True)
        _observe(target, sink, sampler, **options)
        return target, target
    _observe(model, sink, sampler, **options)
    if order == "module.compile":
        model.compile(backend=backend, fullgraph=True)
        return model, model
    return torch.compile(model, backend=backend, fullgraph=True), model


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


# ----------------------------------------------------------------------------- rows equal eager


@pytest.fixture(scope="module", params=["mlp", "block"])
def reference(request: pytest.FixtureRequest) -> tuple[nn.Module, list[torch.Tensor], Any]:
    """The eager rows of the model (plain, and under an ``nn.Sequential`` root, whose layer
    names start with ``0.``), EveryNForwardsSampler(2) over 4 training steps."""
    base, shape = models.build(request.param)
    xs = _inputs(shape)
    plain = _eager(copy.deepcopy(base), xs, EveryNForwardsSampler(2))
    rows = plain[0]
    assert {k[1] for k in rows} == {0, 2}
    assert {k[5] for k in rows} == {"output", "output_gradient"}
    assert {k[5] for k in plain[1]} == {"output", "output_gradient"}
    wrapped = _eager(nn.Sequential(copy.deepcopy(base)), xs, EveryNForwardsSampler(2))
    return base, xs, {"plain": plain, "wrapped": wrapped}


@pytest.mark.parametrize("order", ORDERS)
def test_fullgraph_inductor_trains_and_records_like_eager(
    reference: tuple[nn.Module, list[torch.Tensor], Any], order: str
) -> None:
    """inductor, ``fullgraph=True``: the same rows (identity exactly, values to 1e-4), the same
    histograms and parameters as eager; two graphs per compiled frame (one per sampling
    decision), none added by later samples; no graph break."""
    base, xs, eager = reference
    eager_rows, eager_histograms, eager_params = eager[
        "wrapped" if order == "sequential-root" else "plain"
    ]
    model = _root(copy.deepcopy(base), order)
    sink = MemorySink()
    target, observed = _compile(model, order, "inductor", sink, EveryNForwardsSampler(2))
    try:
        params = _train(target, model, xs)
        assert _graphs() == 2
        _train(target, model, [xs[0]] * 4)  # samples 2 and 3: no recompilation
        assert _graphs() == 2
        assert not counters["graph_break"]
        observer = ti_core.observer_of(observed)
        assert observer is not None
        want = GateState.COMPILED_AHEAD if order == "sequential-root" else GateState.COMPILED
        assert observer.state is want
    finally:
        ti_core.remove_observer(observed)
    rows = _rows(sink)
    _assert_rows_equal({k: v for k, v in rows.items() if k[1] < STEPS}, eager_rows)
    assert {k[1] for k in rows} == {0, 2, 4, 6}
    histograms = {k: v for k, v in _histograms(sink).items() if k[1] < STEPS}
    _assert_histograms_equal(histograms, eager_histograms)
    for a, b in zip(params, eager_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _graph_ops(order: str, sampler: Any, x: torch.Tensor, calls: int) -> list[list[list[str]]]:
    """The ``ti`` operators of each graph Dynamo hands to the backend (no code generation),
    grouped by the call that compiled them."""
    seen: list[list[str]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        seen.append(
            [
                str(n.target).removesuffix(".default")
                for n in gm.graph.nodes
                if str(n.target).startswith("ti.")
            ]
        )
        return gm.forward

    model = _root(models.MLP(), order)
    target, observed = _compile(model, order, backend, MemorySink(), sampler)
    per_call = []
    try:
        for _ in range(calls):
            before = len(seen)
            target(x).sum().backward()
            per_call.append(seen[before:])
    finally:
        ti_core.remove_observer(observed)
    return per_call


@pytest.mark.parametrize("order", ORDERS)
def test_unsampled_graph_holds_nothing_of_the_observer(order: str) -> None:
    """The structural half of the unsampled cost (the timing is benchmarks/compiled.py): the
    unsampled graph is the bare graph, plus one ``advance`` when the root's hooks are traced.
    Forward 0 (sampled) compiles the sampled graph, forward 1 the unsampled one, forward 2
    nothing."""
    x = torch.randn(3, 32)
    leaves = 2 * 4 + 1  # the MLP's selected modules (an nn.Sequential root is not a leaf)
    sampled, unsampled, third = _graph_ops(order, EveryNForwardsSampler(10**9), x, calls=3)
    ops_sampled = [op for graph in sampled for op in graph]
    assert ops_sampled.count("ti.record_call") == leaves
    assert len(sampled) == len(unsampled) == 1  # one frame, one graph per decision
    if order == "sequential-root":
        assert set(ops_sampled) == {"ti.begin", "ti.record_call", "ti.end"}
        assert unsampled == [["ti.advance"]]
    else:
        assert set(ops_sampled) == {"ti.record_call"}
        assert unsampled == [[]]
    assert third == []


# ----------------------------------------------------------------------------- graph breaks


class Broken(nn.Module):
    """Two MLP halves with a graph break of the model's own between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = models.MLP(depth=2)
        self.b = nn.Sequential(nn.Linear(4, 8), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def _explain(attach: Callable[[nn.Module], None] | None, x: torch.Tensor) -> tuple[list[str], int]:
    """(graph breaks, graph count) of ``torch._dynamo.explain`` of a :class:`Broken` model.

    Breaks are Dynamo's own counter (one entry per break, first line of its reason):
    ``explain``'s ``break_reasons`` omit calls of ``torch.compiler.disable``d functions."""
    torch.manual_seed(0)
    model = Broken()
    if attach is not None:
        attach(model)
        model(x)  # eager: takes forward 0, which every sampler here samples
    torch._dynamo.reset()
    counters.clear()
    try:
        out = torch._dynamo.explain(model)(x)
    finally:
        ti_core.remove_observer(model)
    breaks = sorted(
        reason.splitlines()[0] for reason, n in counters["graph_break"].items() for _ in range(n)
    )
    return breaks, int(out.graph_count)


def test_default_compile_adds_no_graph_break() -> None:
    """Observed (then compiled), a model breaks where the bare model breaks and nowhere else,
    sampled or not. The control, a forward hook run eagerly through ``torch.compiler.disable``
    (how ti-core's hooks ran before), shows that the measurement sees added breaks."""
    x = torch.randn(3, 32)
    bare, bare_graphs = _explain(None, x)
    assert len(bare) == 1
    assert bare_graphs == 2

    def observe(sampler: Any) -> Callable[[nn.Module], None]:
        return lambda m: _observe(m, MemorySink(), sampler)

    sampled, sampled_graphs = _explain(observe(AlwaysSampler()), x)
    unsampled, unsampled_graphs = _explain(observe(EveryNForwardsSampler(10**9)), x)
    assert sampled == unsampled == bare
    assert sampled_graphs == unsampled_graphs == bare_graphs

    def eager_hook(m: nn.Module) -> None:
        record = torch.compiler.disable(lambda mod, args, out: None)
        m.a.head.register_forward_hook(record)

    control, _ = _explain(eager_hook, x)
    assert len(control) > len(bare)


def test_unsampled_default_compiled_step_is_one_graph() -> None:
    """With default ``torch.compile`` (graph breaks allowed), after a sampled step an
    unsampled step of the MLP runs one graph: no break, no recompilation per sample (ti-core
    before this change split it into 19 compiled pieces). aot_eager: graphs are Dynamo's."""
    torch.manual_seed(0)
    model = models.MLP()
    x = torch.randn(3, 32)
    _observe(model, MemorySink(), EveryNForwardsSampler(3))
    target = torch.compile(model, backend="aot_eager")
    try:
        for _ in range(7):  # forwards 0, 3, 6 sampled
            target(x).sum().backward()
    finally:
        ti_core.remove_observer(model)
    assert not counters["graph_break"]
    # forward and backward graphs are counted once each per decision
    assert _graphs() == 2
    assert counters["stats"]["calls_captured"] > 0


# ----------------------------------------------------------------------------- semantics


def test_eval_no_grad_records_outputs_only_and_adds_its_own_two_graphs() -> None:
    """Grad mode and the training flag are guarded: eval under ``no_grad`` records outputs with
    ``grad_enabled=False`` and ``mode=eval`` as eager does, in two graphs of its own; switching
    back and forth compiles nothing more. aot_eager: graph selection is Dynamo's."""
    base, shape = models.build("block")
    xs = _inputs(shape, 2)

    def run(compiled: bool) -> tuple[Rows, int]:
        model = copy.deepcopy(base)
        sink = MemorySink()
        torch._dynamo.reset()
        counters.clear()
        target: Any = torch.compile(model, backend="aot_eager") if compiled else model
        # forwards alternate train, eval: every third sampled covers both decisions of each
        _observe(target, sink, EveryNForwardsSampler(3))
        try:
            for x in xs * 2:
                model.train()
                target(x).sum().backward()
                model.eval()
                with torch.no_grad():
                    target(x)
        finally:
            ti_core.remove_observer(target)
        return _rows(sink), _graphs()

    eager, _ = run(False)
    assert {(k[5], k[7], k[8]) for k in eager} == {
        ("output", "eval", False),
        ("output", "train", True),
        ("output_gradient", "train", True),
    }
    rows, graphs = run(True)
    _assert_rows_equal(rows, eager)
    assert graphs == 4


def _live_gradient_states() -> int:
    return sum(isinstance(o, GradientState) for o in gc.get_objects())


def test_gradients_bind_to_their_own_forward_and_state_dies_with_the_graph() -> None:
    """Two outstanding sampled forwards backpropagated in reverse order each get their own
    gradients (the ticket saved for backward binds them); a forward whose backward never comes
    frees its gradient state with its graph. aot_eager: binding is the runtime's."""
    torch.manual_seed(0)
    model = models.MLP(depth=1)
    sink = MemorySink()
    target = torch.compile(model, backend="aot_eager", fullgraph=True)
    _observe(target, sink, AlwaysSampler())
    try:
        x = torch.randn(3, 32)
        first = target(x)
        second = target(x)
        (second * 3).sum().backward()
        first.sum().backward()
        del first, second
        gc.collect()
        assert _live_gradient_states() == 0
        dropped = target(x)
        gc.collect()
        assert _live_gradient_states() == 1
        del dropped
        gc.collect()
        assert _live_gradient_states() == 0
    finally:
        ti_core.remove_observer(target)
    found = [
        r
        for r in sink.table().to_pylist()
        if r["signal"] == "output_gradient" and r["layer"] == "blocks.0.0" and r["metric"] == "mean"
    ]
    by_forward = {r["forward_index"]: r["value"] for r in found}
    # d(loss)/d(first Linear's output), numpy float64: W_head^T summed over outputs, masked by
    # the ReLU; forward 1's loss is 3x forward 0's
    w = model.head.weight.detach().double().numpy()
    h = model.blocks[0][0](x).detach().double().numpy()
    expected = float(((h > 0) * w.sum(axis=0)).mean())
    assert by_forward == pytest.approx({0: expected, 1: 3 * expected}, rel=1e-5)


@pytest.mark.parametrize("order", ["compile-first", "inject-first"])
def test_removal_leaves_a_runnable_compiled_model_without_hooks(order: str) -> None:
    torch.manual_seed(0)
    model = models.MLP(depth=1)
    target, observed = _compile(model, order, "aot_eager", MemorySink(), AlwaysSampler())
    observer = ti_core.observer_of(observed)
    assert observer is not None
    key = observer.gate.trace_key
    x = torch.randn(3, 32)
    target(x).sum().backward()
    ti_core.remove_observer(observed)
    assert observer.state is GateState.CLOSED
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in observed.modules())
    assert operators.target_of(key) is None
    assert operators.FLAGS[key].sampled is False
    torch.testing.assert_close(target(x), model(x))


class _Passthrough(nn.Module):
    """Returns its input unchanged (a leaf when the input is one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _ReturnsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


class _Leafy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.same = _Passthrough()
        self.param = _ReturnsWeight()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.same(x)) * self.param(x)


def test_leaf_outputs_get_gap_rows_in_compiled_graphs() -> None:
    """A module returning its input (a leaf that requires grad) or a parameter: eager hooks the
    leaf and records its gradient; a compiled graph cannot, so it records gradient rows with
    null values and the leaf reason. Every other row is eager's."""
    torch.manual_seed(0)
    base = _Leafy()
    x = torch.randn(2, 3, requires_grad=True)

    def run(compiled: bool) -> Rows:
        model = copy.deepcopy(base)
        sink = MemorySink()
        target: Any = (
            torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        )
        _observe(target, sink, AlwaysSampler())
        try:
            target(x).sum().backward()
        finally:
            ti_core.remove_observer(target)
        return _rows(sink)

    def leaf_gradient(key: tuple[Any, ...]) -> bool:
        return key[2] in ("same", "param") and key[5] == "output_gradient"

    eager, compiled = run(False), run(True)
    assert {k[2] for k in eager if leaf_gradient(k) and eager[k] is not None} == {"same", "param"}
    assert all(k[12] is None for k in eager if leaf_gradient(k))
    gaps = {(k[2], k[12]) for k in compiled if leaf_gradient(k)}
    assert gaps == {("same", LEAF_REASON), ("param", LEAF_REASON)}
    assert all(compiled[k] is None for k in compiled if leaf_gradient(k))
    _assert_rows_equal(
        {k: v for k, v in compiled.items() if not leaf_gradient(k)},
        {k: v for k, v in eager.items() if not leaf_gradient(k)},
    )


@dataclasses.dataclass
class _State:
    hidden: torch.Tensor
    extra: list[torch.Tensor]
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class _Frozen:
    value: torch.Tensor


class _Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


class _Containers(nn.Module):
    """Children returning a dataclass, a frozen dataclass, a named tuple, a dict, an
    OrderedDict and a nested list, each consumed by the parent."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        hidden = h * 2  # returned, and used for "pair" too: its gradient has both paths
        return {
            "state": _State(hidden, [h + 1, h.sum(-1)]),
            "frozen": _Frozen(h * 3),
            "pair": _Pair(hidden.tanh(), h.sigmoid()),
            "nested": [OrderedDict(a=h * 4, b=(h - 1, 7)), None],
            "twice": (h * 5,) * 2,
        }


class _ContainerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.make = _Containers()
        self.mix = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.make(x)
        state, frozen, pair, nested = out["state"], out["frozen"], out["pair"], out["nested"]
        total = state.hidden + state.extra[0] + state.extra[1][..., None] + frozen.value
        total = total + pair.left * pair.right + nested[0]["a"] + nested[0]["b"][0]
        return self.mix(total + out["twice"][0] * out["twice"][1])


def _container_rows(compiled: bool) -> Rows:
    torch.manual_seed(0)
    model = _ContainerModel()
    x = torch.randn(3, 4)
    sink = MemorySink()
    selector: Any = lambda name, m: name in ("make", "mix")  # noqa: E731
    target: Any = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    _observe(target, sink, AlwaysSampler(), selector=selector)
    try:
        target(x).sum().backward()
    finally:
        ti_core.remove_observer(target)
    return _rows(sink)


def test_output_containers_record_like_eager() -> None:
    """Dataclasses (frozen too), named tuples, dicts, OrderedDicts, nested lists, one tensor
    at two paths, a tensor also used inside the module: the same tensor paths, outputs and
    output gradients (every use of the tensor, as eager tensor hooks see it) as eager."""
    eager = _container_rows(False)
    got = _container_rows(True)
    paths_seen = {k[6] for k in eager if k[2] == "make"}
    assert paths_seen == {
        "['state'].hidden",
        "['state'].extra[0]",
        "['state'].extra[1]",
        "['frozen'].value",
        "['pair'].left",
        "['pair'].right",
        "['nested'][0]['a']",
        "['nested'][0]['b'][0]",
        "['twice'][0]",
        "['twice'][1]",
    }
    assert all(k[12] is None for k in eager)  # every gradient captured
    _assert_rows_equal(got, eager)


class _ReadOnly(Mapping[str, torch.Tensor]):
    """An immutable mapping: the traced path cannot put a tap in it."""

    def __init__(self, **items: torch.Tensor) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


OUTPUT_CORPUS: list[Callable[[torch.Tensor], Any]] = [
    lambda t: t,
    lambda t: (t, None, 3, "s"),
    lambda t: [t, [t * 2, (t * 3,)]],
    lambda t: {"a": t, 2: t * 2, ("k", 1): [t]},
    lambda t: OrderedDict(z=t, a={"inner": t + 1}),
    lambda t: _Pair(t, t * 2),
    lambda t: _State(t, [t * 2, t * 3]),
    lambda t: _Frozen(t),
    lambda t: [{"deep": _Pair(_State(t, []), [t])}],
    lambda t: _ReadOnly(x=t, y=t * 2),
    lambda t: (),
]


@pytest.mark.parametrize("make", OUTPUT_CORPUS)
def test_traced_walk_finds_the_eager_paths(make: Callable[[torch.Tensor], Any]) -> None:
    """``traced_leaves`` (traced by Dynamo) gives ``tensor_leaves``' paths in the same order."""
    t = torch.arange(4.0)
    want = [(p, v.tolist()) for p, v in paths.tensor_leaves(make(t))]
    assert [(p, v.tolist()) for p, v in traced_leaves(make(t))] == want

    def walk(x: torch.Tensor) -> Any:
        found = traced_leaves(make(x))
        return tuple(p for p, _ in found), [v for _, v in found]

    got_paths, values = torch.compile(walk, backend="eager", fullgraph=True)(t)
    assert [(p, v.tolist()) for p, v in zip(got_paths, values, strict=True)] == want


class _ReadOnlyChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _ReadOnly:
        return _ReadOnly(h=self.lin(x))


class _ReadOnlyParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.make = _ReadOnlyChild()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.make(x)["h"])


def _read_only_rows(compiled: bool) -> Rows:
    torch.manual_seed(0)
    model = _ReadOnlyParent()
    sink = MemorySink()
    target: Any = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    _observe(target, sink, AlwaysSampler(), selector=lambda name, m: name in ("make", "head"))
    try:
        target(torch.randn(3, 4)).sum().backward()
    finally:
        ti_core.remove_observer(target)
    return _rows(sink)


def test_a_user_mapping_output_records_like_eager() -> None:
    """A ``Mapping`` of the user's own (read-only here): its tensors and their gradients are
    recorded as in eager; the output is never rebuilt or changed."""
    eager = _read_only_rows(False)
    assert {(k[2], k[5], k[6]) for k in eager if k[2] == "make"} == {
        ("make", "output", "['h']"),
        ("make", "output_gradient", "['h']"),
    }
    _assert_rows_equal(_read_only_rows(True), eager)


class _Direct(nn.Module):
    """Calls a child's ``forward`` directly (bypassing its hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.forward(torch.relu(self.body(x)))


def test_capture_direct_forwards_in_compiled_graphs() -> None:
    """``capture_direct_forwards=True`` records direct ``forward`` calls in compiled graphs too:
    the rows of the eager run with the same option."""
    torch.manual_seed(0)
    base = _Direct()
    xs = _inputs((3, 4), 2)
    eager, _, _ = _eager(copy.deepcopy(base), xs, AlwaysSampler(), capture_direct_forwards=True)
    assert {k[2] for k in eager} == {"body", "head"}
    model = copy.deepcopy(base)
    sink = MemorySink()
    target, observed = _compile(
        model, "inject-first", "aot_eager", sink, AlwaysSampler(), capture_direct_forwards=True
    )
    try:
        _train(target, model, xs)
    finally:
        ti_core.remove_observer(observed)
    _assert_rows_equal(_rows(sink), eager)
    assert "forward" not in model.head.__dict__  # the override is gone


def test_threads_bind_each_gradient_to_its_own_forward() -> None:
    """Two threads train one compiled, observed model at once, every forward sampled: each
    forward's rows are its own thread's (the output rows tell the thread by its input, the
    gradient rows by its loss scale), never mixed. aot_eager: binding is the runtime's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    target = torch.compile(model, backend="aot_eager", fullgraph=True)
    sink = MemorySink()
    _observe(target, sink, AlwaysSampler())
    inputs = {1.0: torch.zeros(2, 4), 3.0: torch.ones(2, 4)}
    target(inputs[1.0]).sum().backward()  # compile before the threads start
    errors: list[BaseException] = []

    def work(scale: float) -> None:
        try:
            for _ in range(10):
                (target(inputs[scale]) * scale).sum().backward()
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(scale,)) for scale in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ti_core.remove_observer(target)
    assert not errors
    table = sink.table().to_pylist()
    out = {
        r["forward_index"]: r["value"]
        for r in table
        if r["signal"] == "output" and r["layer"] == "2" and r["metric"] == "mean"
    }
    grad = {
        r["forward_index"]: r["value"]
        for r in table
        if r["signal"] == "output_gradient" and r["layer"] == "2" and r["metric"] == "mean"
    }
    assert len(out) == len(grad) == 21
    with torch.no_grad():
        means = {scale: float(model(x).mean()) for scale, x in inputs.items()}
    # parameters changed between forwards (no optimizer step: they did not), so each output
    # mean is one of the two inputs' and tells the thread
    for index, value in out.items():
        scale = 1.0 if value == pytest.approx(means[1.0], rel=1e-6) else 3.0
        assert value == pytest.approx(means[scale], rel=1e-6)
        assert grad[index] == pytest.approx(scale)


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.inner, x, use_reentrant=False))


def test_activation_checkpoint_inside_a_compiled_graph() -> None:
    """Inside ``torch.utils.checkpoint`` in a compiled graph, outputs are recorded as in eager
    and training is unchanged; the checkpointed modules' gradient rows are nulls with a reason
    (AOT autograd cannot save an effectful operator's result there), the others are recorded."""
    torch.manual_seed(0)
    base = _Checkpointed()
    xs = _inputs((3, 4), 2)
    eager, _, eager_params = _eager(copy.deepcopy(base), xs, AlwaysSampler())
    model = copy.deepcopy(base)
    sink = MemorySink()
    target, observed = _compile(model, "compile-first", "aot_eager", sink, AlwaysSampler())
    try:
        params = _train(target, model, xs)
    finally:
        ti_core.remove_observer(observed)
    got = _rows(sink)
    inner = {"inner.0", "inner.1"}
    for key, value in eager.items():
        if key[5] == "output_gradient" and key[2] in inner:
            gap = (*key[:11], key[11], NESTED_REASON)
            assert got[gap] is None
        else:
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert len(got) == len(eager)
    for a, b in zip(params, eager_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_decided_ahead_forwards_count_like_eager() -> None:
    """A root whose hooks are traced (``nn.Sequential``) decides each forward when the previous
    one ends; compiled and eager forwards of it share one count, so the sampled forward indices
    are the sampler's: 0, 3, 6, 9 over 12 forwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    sink = MemorySink()
    _observe(model, sink, EveryNForwardsSampler(3))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 4)
    try:
        for call in [compiled] * 5 + [model] * 3 + [compiled] * 4:
            call(x).sum().backward()
        observer = ti_core.observer_of(model)
        assert observer is not None
        assert observer.state is GateState.COMPILED_AHEAD
    finally:
        ti_core.remove_observer(model)
    table = sink.table().to_pylist()
    assert sorted({(r["sample_id"], r["forward_index"]) for r in table}) == [
        (0, 0),
        (1, 3),
        (2, 6),
        (3, 9),
    ]


def test_cuda_graphs_are_refused_with_a_clear_message() -> None:
    """CUDA graphs (``mode="reduce-overhead"``) replay without Python, and inductor cannot tell
    ti-core's operators from kernels it may record (see test_torch_apis.py): refused
    at attach for a compiled module, at the first trace for a module compiled after it was
    observed. On CPU the mode has no effect, so the refusal is checked here."""
    model = models.MLP(depth=1)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with pytest.raises(ValueError, match="does not support CUDA graphs") as raised:
        _observe(compiled, MemorySink(), AlwaysSampler())
    assert CUDA_GRAPHS_REFUSED in str(raised.value)
    assert not ti_core.has_observer(compiled)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in compiled.modules())

    sink = MemorySink()
    _observe(model, sink, AlwaysSampler())
    try:
        with pytest.raises(Exception, match="does not support CUDA graphs"):
            torch.compile(model, mode="reduce-overhead", fullgraph=True)(torch.randn(2, 32))
    finally:
        ti_core.remove_observer(model)
    # the default mode of the same model compiles and records
    torch._dynamo.reset()
    sink = MemorySink()
    _observe(model, sink, AlwaysSampler())
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(2, 32))
    finally:
        ti_core.remove_observer(model)
    assert sink.table().num_rows > 0
