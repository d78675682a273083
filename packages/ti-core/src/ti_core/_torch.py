"""Every private PyTorch name ti-core relies on, in one place: the one door to torch's internals.

torch is pinned (constraints/torch.txt); each name here is guarded by a test in
``packages/ti-core/tests/test_torch_apis_eager.py`` (eager) or ``test_torch_apis.py``
(compiled) that fails, naming the API, when a torch upgrade moves or changes it, and
tests/test_torch_door.py fails on a private torch name used anywhere else in the project's
sources. Eager capture uses the autograd engine's graph-task id and
end-of-backward callback, a tensor's version counter, a module's own parameter table and
``Module._call_impl``, the autocast flag and the fused norm; the compiled path uses Dynamo's
markers and trace-time state. Nothing here imports ``torch._dynamo`` (seconds and ~80 MB): what
is needed before any compile comes from torch's C extension or is a marker attribute; Dynamo's
Python internals are imported at trace time only, when Dynamo is loaded anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final, TypeVar

import torch
from torch._library.effects import EffectType

_F = TypeVar("_F", bound=Callable[..., Any])

# --- eager capture ---------------------------------------------------------------------------


def current_graph_task_id() -> int:
    """The id of the backward the autograd engine is running on this thread (-1: none): tells
    a hook called during a backward from one called by a forward, and one backward from the
    next (``torch._C._current_graph_task_id``)."""
    return int(torch._C._current_graph_task_id())


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward has finished (every gradient of this
    graph task computed); only valid inside a backward
    (``Variable._execution_engine.queue_callback``)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: it moves at every in-place write, so two reads of the same
    counter tell an unchanged tensor from a rewritten one (``Tensor._version``)."""
    return int(tensor._version)


def own_parameter(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The parameter ``module`` registers under ``name`` itself (not a submodule's), or None
    (``Module._parameters``; ``getattr`` would also find a plain attribute)."""
    return module._parameters.get(name)


MODULE_CALL_IMPL: Final[Callable[..., Any]] = torch.nn.Module._call_impl
"""What ``module(...)`` runs (its hooks around ``forward``): ``Module.__call__`` looks it up as
``self._call_impl``, so a callable put in an instance's ``__dict__`` under
:data:`CALL_IMPL_ATTRIBUTE` is called instead (what ti-core's call override does)."""
CALL_IMPL_ATTRIBUTE: Final[str] = "_call_impl"

HOOK_DICTS: Final[tuple[str, ...]] = ("_forward_pre_hooks", "_forward_hooks")
"""A module's forward (pre-)hooks, ``{handle id: hook}``, in its ``__dict__``."""
HOOK_ID_SETS: Final[tuple[str, ...]] = (
    "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
)
"""The per-hook flags beside :data:`HOOK_DICTS`, keyed by the same handle ids."""


def default_call_path(module: torch.nn.Module) -> bool:
    """Whether ``module(...)`` runs torch's own ``__call__`` / ``_wrapped_call_impl`` /
    ``_call_impl`` (not overridden by its class or instance, not scripted, no
    ``module.compile()`` of its own): only then does an instance-level ``_call_impl`` see each
    call."""
    cls = type(module)
    return (
        cls.__call__ is torch.nn.Module.__call__
        and cls._wrapped_call_impl is torch.nn.Module._wrapped_call_impl
        and cls._call_impl is torch.nn.Module._call_impl
        and CALL_IMPL_ATTRIBUTE not in module.__dict__
        and not isinstance(module, torch.jit.ScriptModule)
        and getattr(module, "_compiled_call_impl", None) is None
    )


any_autocast_enabled: Final[Callable[[], bool]] = torch._C._is_any_autocast_enabled
"""Whether autocast is on for any device type on this thread (one C call: the replay refuses
to run under a different autocast state than the forward it replays)."""


def foreach_norm(
    tensors: list[torch.Tensor], order: float, dtype: torch.dtype | None
) -> list[torch.Tensor]:
    """The ``order``-norm of each of ``tensors``, in ``dtype`` (None: theirs), as one fused
    multi-tensor kernel on an accelerator (``torch._foreach_norm``)."""
    return list(torch._foreach_norm(tensors, order, dtype=dtype))


def compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``torch.compile``'d ``OptimizedModule`` wraps (its ``_orig_mod``); None for
    any other module (a module of another class with such an attribute included)."""
    inner = getattr(module, "_orig_mod", None)
    if isinstance(inner, torch.nn.Module) and type(module).__name__ == "OptimizedModule":
        return inner
    return None


def default_store() -> Any | None:
    """The key-value store ``init_process_group`` created (the rendezvous store every rank of
    the job reaches), or None when no default process group is initialized (or torch has no
    ``torch.distributed``): ``torch.distributed`` has no public accessor for it
    (``distributed_c10d._get_default_store``). Only the store's public methods (``set``,
    ``get``, ``check``, ``compare_set``) are used on what it returns."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# --- the compiled path -----------------------------------------------------------------------


def assume_constant_result(function: _F) -> _F:
    """``torch._dynamo.assume_constant_result`` without importing ``torch._dynamo``: the same
    marker attribute (a test compares them). Dynamo calls the marked function at trace time,
    with the real (constant) arguments, and folds its result into the graph: the one way
    traced code runs Python once per trace."""
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return function


def skip_frames(function: Callable[..., Any]) -> bool:
    """Tell Dynamo to run ``function``'s frame, and every frame it calls, eagerly when it meets
    it as a frame of its own (``set_code_exec_strategy`` with ``FrameAction.SKIP``); inlined
    calls are still traced. False when this torch has no such setting."""
    try:  # torch's C extension, which torch._dynamo.eval_frame / .types re-export
        from torch._C._dynamo.eval_frame import (  # type: ignore[import-not-found,attr-defined,unused-ignore]
            _FrameAction as FrameAction,
        )
        from torch._C._dynamo.eval_frame import (  # type: ignore[import-not-found,attr-defined,unused-ignore]
            _FrameExecStrategy as FrameExecStrategy,
        )
        from torch._C._dynamo.eval_frame import (  # type: ignore[import-not-found,attr-defined,unused-ignore]
            set_code_exec_strategy,
        )
    except ImportError:  # pragma: no cover - depends on the torch build
        return False
    set_code_exec_strategy(function.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return True


def _current_output() -> Any:
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx().output


def compiler_config() -> Mapping[str, Any] | None:
    """Trace time: inductor's configuration for the ``torch.compile`` call being traced (its
    ``mode`` and ``options`` applied, e.g. ``"triton.cudagraphs": True`` for
    ``mode="reduce-overhead"``); None for a backend other than inductor."""
    return _backend_config(_current_output().compiler_fn)


_BACKWARD_WRITES_VERIFIED: Final = ("2.13.",)
"""The torch releases whose inductor is known to write a backward graph's mutation of a
forward input in its own kernels (test_torch_apis.py runs it on the pinned one)."""


def backward_writes_keep_versions() -> bool:
    """Trace time: whether the graph being traced is compiled by an inductor whose backward
    graphs write a global tensor without bumping its version counter. Autograd checks that
    counter for every tensor a backward saved: with ``aot_eager`` (real in-place kernels), a
    tensor written by one backward makes the backward of an earlier forward refuse it (two
    forwards, then two backwards). Releases not verified answer False (the safe path)."""
    return compiler_config() is not None and torch.__version__.startswith(_BACKWARD_WRITES_VERIFIED)


def optimized_config(compiled: Any) -> Mapping[str, Any] | None:
    """The same for a ``torch.compile``d module (``OptimizedModule``), found through the
    wrappers Dynamo puts around the backend (``dynamo_ctx.callback``, then each one's
    ``_torchdynamo_orig_backend``)."""
    context = getattr(compiled, "dynamo_ctx", None)
    return _backend_config(getattr(context, "callback", None))


def _backend_config(backend: Any) -> Mapping[str, Any] | None:
    for _ in range(8):
        if backend is None:
            return None
        get = getattr(backend, "get_compiler_config", None)
        if callable(get):
            config = get()
            return config if isinstance(config, Mapping) else None
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
    return None


def current_compile_id() -> Hashable:
    """Trace time: the id of the compile being traced (one per graph Dynamo makes of a frame,
    recompiles included: ``torch._guards.CompileContext.current_compile_id``)."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()


def in_nested_region() -> bool:
    """Trace time: whether the code being traced is the body of a higher-order region inside
    the graph (``torch.utils.checkpoint``, ``torch.cond``, ...), traced by a nested tracer."""
    return _current_output().current_tracer.parent is not None


__all__ = [
    "CALL_IMPL_ATTRIBUTE",
    "HOOK_DICTS",
    "HOOK_ID_SETS",
    "MODULE_CALL_IMPL",
    "EffectType",
    "any_autocast_enabled",
    "assume_constant_result",
    "backward_writes_keep_versions",
    "compiled_inner",
    "compiler_config",
    "current_compile_id",
    "current_graph_task_id",
    "default_call_path",
    "default_store",
    "foreach_norm",
    "in_nested_region",
    "optimized_config",
    "own_parameter",
    "queue_callback",
    "skip_frames",
    "version",
]
