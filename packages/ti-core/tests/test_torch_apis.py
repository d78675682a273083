"""The private PyTorch behaviour capture in compiled graphs relies on, one test each.

torch is pinned (constraints/torch.txt). When an upgrade moves or changes one of these, its test
fails with a message naming the API and what in ti-core depends on it
(``ti_core/_torch.py`` holds every such use). Backends are the cheapest that
show the behaviour; inductor where only code generation shows it.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import fx, nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from ti_core import _torch
from ti_core.compiled import operators
from ti_core.compiled.operators import TICKET_STATE
from ti_core.compiled.slots import flag_into

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _aot_forward_targets(fn: Any, *args: Any) -> list[str]:
    """The call targets of the AOT autograd forward graph of ``fn`` (no code generation)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[fx.GraphModule] = []

    def fw(gm: fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(*args)
    return [
        f"{n.target}({n.args[1]})" if str(n.target) == "with_effects" else str(n.target)
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function"
    ]


def test_effect_declaration_keeps_an_unused_operator_in_the_graph() -> None:
    """``torch._library.effects.EffectType.ORDERED`` through ``CustomOpDef.register_effect``:
    without it AOT autograd drops an operator whose result is unused as dead code; the ``ti``
    operators rely on it to run at all (their tickets are unused without gradients)."""
    calls: list[int] = []

    @torch.library.custom_op("ti_api_test::plain", mutates_args=())
    def plain(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.zeros(1)

    plain.register_fake(lambda x: torch.empty(1))

    def use(x: torch.Tensor) -> torch.Tensor:
        torch.ops.ti_api_test.plain(x)
        operators.record_call([x], -1, 0, 0, True, False, [operators.PLAIN])
        return x * 2

    targets = " ".join(_aot_forward_targets(use, torch.ones(2, requires_grad=True)))
    assert "ti_api_test.plain" not in targets, "torch no longer removes an unused pure op"
    assert "ti.record_call" in targets, (
        "torch._library.effects.EffectType.ORDERED / CustomOpDef.register_effect no longer keeps "
        "an unused effectful custom op in the AOT graph: ti_core.compiled.operators needs another "
        "way to keep its operators"
    )
    assert "with_effects(ti.record_call.default)" in targets


def test_assume_constant_result_runs_once_per_trace_and_folds_the_result() -> None:
    """``torch._dynamo.assume_constant_result``: called at trace time with the real arguments,
    its result folded into the graph, not called when the graph runs (``_enter_compiled`` and
    ``_site`` in ti_core.compiled.traced rely on it)."""
    seen: list[tuple[int, str]] = []

    def marked(fn: Any) -> Any:
        return fn

    mine = _torch.assume_constant_result(marked)
    assert vars(mine) == vars(torch._dynamo.assume_constant_result(lambda: None)), (
        "torch._dynamo.assume_constant_result marks functions differently now: "
        "ti_core._torch.assume_constant_result copies its marker"
    )

    @_torch.assume_constant_result
    def note(n: int, s: str) -> int:
        seen.append((n, s))
        return n + 1

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * note(41, "paths")

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    out = [compiled(torch.ones(1)) for _ in range(3)]
    assert seen == [(41, "paths")], (
        "torch._dynamo.assume_constant_result no longer runs exactly once per trace"
    )
    assert all(float(o) == 42.0 for o in out)


def test_frame_skip_strategy_runs_a_hook_frame_eagerly() -> None:
    """``torch._dynamo.eval_frame.set_code_exec_strategy`` with
    ``FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)``: a hook that ``Module._call_impl``
    calls under ``torch.compile`` runs eagerly instead of being compiled as a frame of its own
    (ti-core's root hooks rely on it to decide before the compiled forward starts)."""
    inside: list[bool] = []

    class Hook:
        def __call__(self, module: nn.Module, args: Any) -> None:
            inside.append(torch.compiler.is_compiling())

    class Skipped(Hook):
        def __call__(self, module: nn.Module, args: Any) -> None:
            inside.append(torch.compiler.is_compiling())

    assert _torch.skip_frames(Skipped.__call__), (
        "torch._C._dynamo.eval_frame.set_code_exec_strategy / _FrameAction / "
        "_FrameExecStrategy moved: ti_core._torch.skip_frames cannot skip frames"
    )
    import torch._dynamo.eval_frame
    import torch._dynamo.types
    from torch._C._dynamo import eval_frame as c_eval_frame

    moved = (
        "torch._dynamo's set_code_exec_strategy / FrameAction / FrameExecStrategy are no longer "
        "torch._C._dynamo.eval_frame's: ti_core._torch.skip_frames uses the latter"
    )
    ours = torch._dynamo.eval_frame.set_code_exec_strategy
    assert ours is c_eval_frame.set_code_exec_strategy, moved
    assert torch._dynamo.types.FrameAction is c_eval_frame._FrameAction, moved
    assert torch._dynamo.types.FrameExecStrategy is c_eval_frame._FrameExecStrategy, moved

    class User(nn.Module):  # a user forward: the hooks run as frames, not inlined
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    for hook, compiled_hook in ((Hook(), True), (Skipped(), False)):
        torch._dynamo.reset()
        counters.clear()
        inside.clear()
        model = User()
        model.register_forward_pre_hook(hook)
        torch.compile(model, backend="eager")(torch.ones(1, 2))
        assert inside == [compiled_hook], (
            "Dynamo changed how it runs hooks called by Module._call_impl under torch.compile"
        )


def test_a_gradient_hook_traced_into_the_graph_gets_its_ticket_and_every_use() -> None:
    """Two behaviours of torch 2.13 (inductor): ``Tensor.register_hook`` on an intermediate is
    traced into a ``fullgraph=True`` graph (``register_hook_op``) and fires with the gradient
    accumulated over every use of the tensor, as in eager; and the Python attribute set on a
    custom op's output (the ticket) is still there when the compiled backward hands the saved
    tensor to the hook (PyObject preservation). ti-core binds gradients to their sample
    through both."""
    received: list[Any] = []

    def receive(grad: torch.Tensor | None) -> None:
        received.append((0, None if grad is None else grad.clone()))

    @torch.library.custom_op("ti_api_test::ticket", mutates_args=())
    def make_ticket(x: torch.Tensor) -> torch.Tensor:
        ticket = torch.zeros(1, dtype=torch.int64)
        setattr(ticket, TICKET_STATE, [receive])
        return ticket

    make_ticket.register_fake(lambda x: torch.empty(1, dtype=torch.int64))
    make_ticket.register_effect(_torch.EffectType.ORDERED)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        used_before = h.sum() * 2  # the hook sees every use of h, as an eager tensor hook
        ticket = make_ticket(h)
        h.register_hook(lambda grad: operators.record_grad(grad, ticket, 0))
        return (h * 3).sum() + used_before

    x = torch.ones(3, requires_grad=True)
    torch.compile(fn, backend="inductor", fullgraph=True)(x).backward()
    assert len(received) == 1, (
        "Tensor.register_hook on an intermediate inside torch.compile(fullgraph=True), with a "
        "Python attribute on the custom op output it closes over: the attribute no longer "
        "reaches the backward, so ti_core.compiled.operators.record_grad finds no state"
    )
    torch.testing.assert_close(received[0][1], torch.full((3,), 5.0))


def test_compiler_config_of_the_compile_being_traced_and_of_a_compiled_module() -> None:
    """``InstructionTranslator.current_tx().output.compiler_fn.get_compiler_config()`` at trace
    time, and the backend behind ``OptimizedModule.dynamo_ctx.callback`` (followed through
    ``_torchdynamo_orig_backend``): how ti-core sees ``mode="reduce-overhead"`` (CUDA graphs),
    which it refuses."""
    seen: list[Any] = []

    @_torch.assume_constant_result
    def look() -> bool:
        config = _torch.compiler_config()
        seen.append(None if config is None else config.get("triton.cudagraphs"))
        return True

    def fn(x: torch.Tensor) -> torch.Tensor:
        look()
        return x + 1

    model = nn.Linear(2, 2)
    for options, want in (
        ({"mode": "reduce-overhead"}, True),
        ({"mode": "max-autotune-no-cudagraphs"}, False),
        ({}, False),
        ({"backend": "aot_eager"}, None),
    ):
        torch._dynamo.reset()
        seen.clear()
        torch.compile(fn, fullgraph=True, **options)(torch.ones(2))
        message = f"Dynamo no longer exposes the compile options being traced ({options})"
        assert seen == [want], message
        config = _torch.optimized_config(torch.compile(model, fullgraph=True, **options))
        got = None if config is None else config.get("triton.cudagraphs")
        assert got == want, f"an OptimizedModule no longer leads to its compile options ({options})"


def test_a_nested_region_is_seen_at_trace_time() -> None:
    """``current_tx().output.current_tracer.parent``: set while Dynamo traces the body of
    ``torch.utils.checkpoint`` (a higher-order region), where ti-core does not tap gradients."""
    seen: list[bool] = []

    @_torch.assume_constant_result
    def look() -> bool:
        seen.append(_torch.in_nested_region())
        return True

    def body(x: torch.Tensor) -> torch.Tensor:
        look()
        return x.tanh()

    def fn(x: torch.Tensor) -> torch.Tensor:
        look()
        return checkpoint(body, x, use_reentrant=False).sum()

    torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2, requires_grad=True))
    assert seen == [False, True], "Dynamo's nested tracers (checkpoint bodies) changed"


def test_a_ticket_saved_inside_checkpoint_still_breaks_aot_autograd() -> None:
    """Tripwire: AOT autograd (2.13) cannot save an effectful operator's result for backward
    inside ``torch.utils.checkpoint`` ('expected all tensors_saved_with_vc_check to be
    Tensors'), so ti-core records no gradients there (docs/capture.md). When this starts to
    work, gradients inside checkpointed compiled regions can be captured: drop the NESTED gap."""

    def body(x: torch.Tensor) -> torch.Tensor:
        h = x.tanh()
        ticket = operators.record_call([h], -1, 0, 0, True, True, [operators.WATCH])
        h.register_hook(lambda grad: operators.record_grad(grad, ticket, 0))
        return h

    def fn(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(body, x, use_reentrant=False).sum()

    with pytest.raises(Exception, match="tensors_saved_with_vc_check"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(torch.ones(2, requires_grad=True))


def test_inductor_does_not_see_cudagraph_unsafe_through_the_effect_wrapper() -> None:
    """Tripwire for the CUDA-graph refusal: inductor decides what a CUDA graph may record with
    ``torch._inductor.utils.is_cudagraph_unsafe_fx_node``, which reads the ``cudagraph_unsafe``
    tag of the node's target; an effectful operator's node is ``with_effects(token, op, ...)``,
    so the tag of ``ti.record_call`` is not seen. When it is, CUDA graphs may become supportable
    (a device run must confirm): revisit ``CUDA_GRAPHS_REFUSED``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    nodes: list[fx.Node] = []

    def fw(gm: fx.GraphModule, example_inputs: Any) -> Any:
        nodes.extend(n for n in gm.graph.nodes if "record_call" in str(n.args))
        return gm.forward

    def fn(x: torch.Tensor) -> torch.Tensor:
        operators.record_call([x], -1, 0, 0, True, False, [operators.PLAIN])
        return x * 2

    torch.compile(fn, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(torch.ones(2))
    assert [str(n.target) for n in nodes] == ["with_effects"]
    assert torch.Tag.cudagraph_unsafe in torch.ops.ti.record_call.default.tags
    assert not is_cudagraph_unsafe_fx_node(nodes[0]), (
        "inductor now sees cudagraph_unsafe through with_effects: CUDA graphs may be supportable"
    )


def test_dynamo_guards_on_a_flag_read_through_a_module_dict() -> None:
    """Reading ``FLAGS[key].sampled`` installs a guard: flipping it selects the other cached
    graph, compiled once (no recompilation per sample). A ``threading.local`` attribute is not
    guarded (its value is baked into the graph), which is why the decision is per observer,
    not per thread."""
    key, flags = 987_654, operators.TraceFlags(None)
    operators.FLAGS[key] = flags
    try:

        def fn(x: torch.Tensor) -> torch.Tensor:
            return x * 2 if operators.FLAGS[key].sampled else x + 1

        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        x = torch.full((2,), 3.0)
        got = []
        for sampled in (False, True, False, True):
            flags.sampled = sampled
            got.append(float(compiled(x)[0]))
        assert got == [4.0, 6.0, 4.0, 6.0]
        assert counters["stats"]["unique_graphs"] == 2, "Dynamo no longer guards on the flag"
    finally:
        del operators.FLAGS[key]

    class Local(threading.local):
        sampled = False

    local = Local()

    def per_thread(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if local.sampled else x + 1

    torch._dynamo.reset()
    compiled = torch.compile(per_thread, backend="eager", fullgraph=True)
    compiled(x)
    local.sampled = True
    assert float(compiled(x)[0]) == 4.0, (
        "Dynamo now guards on threading.local attributes: per-thread sampling decisions in "
        "compiled graphs may be possible (docs/capture.md, threads)"
    )


def test_compile_ids_tell_graphs_apart_and_a_graph_writes_a_global_tensor_back() -> None:
    """``torch._guards.CompileContext.current_compile_id`` (``ti_core._torch``): one value
    while one graph is traced (also when Dynamo traces it again after a graph break), another
    for the next graph; the sentinel's
    slots (``ti_core.compiled.slots``) number each call per graph by it. And a compiled graph
    (inductor) that writes a tensor reached through a global object writes it back when it
    returns, handing an operator the values it has written so far, without saving the tensor
    for backward (a second forward before the backward does not break it)."""
    ids: list[object] = []

    @_torch.assume_constant_result
    def note() -> int:
        ids.append(_torch.current_compile_id())
        return 0

    class Box:
        slots = torch.zeros(4, dtype=torch.int64)

    seen: list[list[int]] = []

    @torch.library.custom_op("ti_api_test::look", mutates_args=())
    def look(values: list[torch.Tensor]) -> None:
        seen.append(values[0].tolist())

    look.register_fake(lambda values: None)
    look.register_effect(_torch.EffectType.ORDERED)  # type: ignore[attr-defined]

    def fn(x: torch.Tensor) -> torch.Tensor:
        note()
        y = x * 2
        Box.slots[1] = torch.where(torch.isfinite(y).all(), Box.slots[1], 7)
        note()
        look([Box.slots])
        torch._dynamo.graph_break()
        note()
        return y.sin()

    compiled = torch.compile(fn)
    x = torch.tensor([1.0, math.inf], requires_grad=True)
    (compiled(x).sum() + compiled(x).sum()).backward()
    # (Dynamo traces the first frame again after the graph break: the same id again.)
    names_graphs = len(set(ids)) == 2 and ids[0] == ids[1] != ids[-1]
    assert names_graphs, (
        "torch._guards.CompileContext.current_compile_id no longer names one graph per trace: "
        "ti_core.compiled.slots needs another way to give each graph's calls their own slots"
    )
    assert Box.slots.tolist() == [0, 7, 0, 0], "a graph no longer writes a global tensor back"
    assert seen[0] == [0, 7, 0, 0], (
        "an operator no longer sees a graph's writes to a global tensor before the graph "
        "returns: ti_core.compiled.traced passes the slots to ti::advance / ti::end for this"
    )


def test_inductor_backward_writes_a_global_tensor_without_bumping_its_version() -> None:
    """Inductor's backward graph writes a global tensor that a gradient hook mutates in its own
    kernels, so the tensor's version counter stays, and autograd still accepts it as saved for
    the backward of an earlier forward (two forwards, then two backwards). ``aot_eager`` runs
    real in-place kernels and bumps it, so autograd refuses that pattern. The sentinel's
    gradient slots (``_torch.backward_writes_keep_versions``) rely on the difference, and
    are used only where it holds."""
    seen: list[bool] = []

    @_torch.assume_constant_result
    def look() -> bool:
        seen.append(_torch.backward_writes_keep_versions())
        return True

    class Box:
        slots = torch.zeros(3, dtype=torch.int64)
        sequence = torch.zeros(1, dtype=torch.int64)

    def flagger(slot: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            flag_into(Box.slots, Box.sequence, slot, grad.detach())

        return hook

    weight = nn.Parameter(torch.ones(4))

    def fn(x: torch.Tensor) -> torch.Tensor:
        look()
        y = x * weight
        y.register_hook(flagger(1))
        z = torch.sqrt(y)
        z.register_hook(flagger(2))
        return z.sum()

    def train(backend: str) -> None:
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        x = torch.tensor([1.0, 4.0, 0.0, 9.0])  # sqrt'(0) is infinite: y's gradient
        first, second = compiled(x), compiled(x)
        first.backward()
        second.backward()

    versions = (Box.slots._version, Box.sequence._version)
    train("inductor")
    assert seen == [True], (
        "_torch.backward_writes_keep_versions no longer sees inductor on this torch"
    )
    assert (Box.slots._version, Box.sequence._version) == versions, (
        "inductor's backward now bumps the version of a global tensor it writes: the "
        "sentinel's gradient slots would make autograd refuse gradient accumulation"
    )
    # z's gradient (ones) is checked first, y's (inf at 0) second: in arrival order, per backward
    assert Box.slots.tolist() == [0, 4, 0]
    assert Box.sequence.tolist() == [4]
    seen.clear()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train("aot_eager")
    assert seen == [False]
