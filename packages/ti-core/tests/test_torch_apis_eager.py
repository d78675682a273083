"""The private PyTorch behaviour eager capture relies on, one test each (``ti_core._torch``).

torch is pinned (constraints/torch.txt). When an upgrade moves or changes one of these names,
its test fails here, naming it; the compiled path's names are guarded in test_torch_apis.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ti_core import _torch


def test_graph_task_id_is_minus_one_outside_a_backward_and_set_inside() -> None:
    """Tells a hook run by a backward (activation checkpointing's recomputation) from one run
    by a forward, and one backward from the next (call_context.py,
    capture/parameter_gradients.py)."""
    assert _torch.current_graph_task_id() == -1
    seen: list[int] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(_torch.current_graph_task_id()))
    y.sum().backward()
    z = x * 3
    z.register_hook(lambda grad: seen.append(_torch.current_graph_task_id()))
    z.sum().backward()
    assert len(seen) == 2
    assert all(task >= 0 for task in seen)
    assert seen[0] != seen[1], "_current_graph_task_id no longer tells two backwards apart"


def test_queued_callback_runs_once_every_gradient_of_the_backward_is_in() -> None:
    """Gradient capture and the flight recorder read ``.grad`` and flush their batches at the
    end of a backward (``Variable._execution_engine.queue_callback``)."""
    layer = nn.Linear(4, 2)
    seen: list[bool] = []

    def queue(grad: torch.Tensor) -> None:
        _torch.queue_callback(lambda: seen.append(layer.weight.grad is not None))

    out = layer(torch.ones(1, 4))
    out.register_hook(queue)
    out.sum().backward()
    assert seen == [True], "queue_callback ran before the weight's gradient was accumulated"


def test_version_counter_moves_at_each_in_place_write() -> None:
    """The replay refuses an argument changed in place since its forward; a batch tells a
    rewritten tensor from an unchanged one (``Tensor._version``)."""
    t = torch.zeros(3)
    before = _torch.version(t)
    t.add_(1)
    assert _torch.version(t) == before + 1
    _ = t + 1  # out of place: unchanged
    assert _torch.version(t) == before + 1


def test_own_parameter_finds_only_what_the_module_registers_itself() -> None:
    """Parameter capture re-reads a module's own parameter (FSDP2 swaps it during forward)
    without finding a submodule's or a plain attribute (``Module._parameters``)."""
    model = nn.Sequential(nn.Linear(2, 2))
    model.extra = torch.zeros(1)  # type: ignore[assignment]
    linear = model[0]
    assert _torch.own_parameter(linear, "weight") is linear.weight
    assert _torch.own_parameter(model, "weight") is None
    assert _torch.own_parameter(model, "extra") is None


def test_an_instance_call_impl_is_what_module_call_runs() -> None:
    """The default eager capture puts a callable in a module's ``__dict__`` under
    ``_call_impl`` and calls torch's ``Module._call_impl`` from it (capture/hooks.py)."""
    layer = nn.Linear(2, 2)
    assert _torch.default_call_path(layer)
    calls: list[int] = []

    def override(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return _torch.MODULE_CALL_IMPL(layer, *args, **kwargs)

    hooked: list[int] = []
    layer.register_forward_hook(lambda m, a, o: hooked.append(1))
    layer.__dict__[_torch.CALL_IMPL_ATTRIBUTE] = override
    x = torch.ones(1, 2)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert calls == [1], "Module.__call__ no longer looks up the instance's _call_impl"
    assert hooked == [1], "Module._call_impl no longer runs the forward hooks"
    assert not _torch.default_call_path(layer)  # overridden on the instance
    del layer.__dict__[_torch.CALL_IMPL_ATTRIBUTE]

    class OwnCall(nn.Linear):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    assert not _torch.default_call_path(OwnCall(2, 2))
    compiled = nn.Linear(2, 2)
    compiled.compile()  # sets _compiled_call_impl; nothing is compiled until a call
    assert not _torch.default_call_path(compiled)


def test_forward_hook_tables_are_keyed_by_handle_id() -> None:
    """A copy of an observed module (``copy.deepcopy``, DataParallel's replicas) keeps our
    inert hooks; they are removed from these tables by handle id (capture/hooks.py)."""
    layer = nn.Linear(2, 2)
    pre = layer.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    post = layer.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)
    for name in _torch.HOOK_DICTS:
        assert isinstance(layer.__dict__[name], dict), name
    assert pre.id in layer.__dict__["_forward_pre_hooks"]
    assert post.id in layer.__dict__["_forward_hooks"]
    for name in _torch.HOOK_ID_SETS:
        assert isinstance(layer.__dict__[name], dict), name
    assert pre.id in layer.__dict__["_forward_pre_hooks_with_kwargs"]
    assert post.id in layer.__dict__["_forward_hooks_with_kwargs"]
    assert post.id in layer.__dict__["_forward_hooks_always_called"]


def test_any_autocast_flag_follows_autocast() -> None:
    """The replay refuses a step whose autocast state it cannot restore
    (``torch._C._is_any_autocast_enabled``)."""
    assert _torch.any_autocast_enabled() is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _torch.any_autocast_enabled() is True
    assert _torch.any_autocast_enabled() is False


def test_a_compiled_module_wraps_the_original_as_orig_mod() -> None:
    """Layer names are the bare model's: ``torch.compile``'s wrapper is peeled
    (``OptimizedModule._orig_mod``; selection.py, the replay's DDP check)."""
    layer = nn.Linear(2, 2)
    compiled = torch.compile(layer)  # nothing is compiled until a call
    assert type(compiled).__name__ == "OptimizedModule"
    assert _torch.compiled_inner(compiled) is layer
    assert _torch.compiled_inner(layer) is None
    impostor = nn.Module()
    impostor._orig_mod = layer  # type: ignore[assignment]  # not an OptimizedModule
    assert _torch.compiled_inner(impostor) is None


def test_foreach_norm_equals_each_tensors_norm() -> None:
    """The flight recorder's one fused check of every parameter gradient
    (``torch._foreach_norm``)."""
    tensors = [torch.randn(5), torch.randn(3, 4), torch.tensor([float("nan"), 1.0])]
    norms = _torch.foreach_norm(tensors, 2.0, None)
    for tensor, norm in zip(tensors[:2], norms[:2], strict=True):
        torch.testing.assert_close(norm, torch.linalg.vector_norm(tensor))
    assert torch.isnan(norms[2])
    half = _torch.foreach_norm([torch.ones(4, dtype=torch.float16)], 2.0, torch.float32)
    assert half[0].dtype == torch.float32
    assert half[0].item() == 2.0
