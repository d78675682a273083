"""Every private PyTorch API the compiled path relies on, in one place.

torch is pinned (constraints/torch.txt); each name here is guarded by a test in
``packages/ti-core/tests/test_compiled_torch_apis.py`` that fails, naming the API, when a torch
upgrade moves or changes it. Nothing here imports ``torch._dynamo`` (seconds and ~80 MB): what
is needed before any compile comes from torch's C extension or is a marker attribute; Dynamo's
Python internals are imported at trace time only, when Dynamo is loaded anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final, TypeVar

import torch
from torch._library.effects import EffectType

_F = TypeVar("_F", bound=Callable[..., Any])


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
forward input in its own kernels (test_compiled_torch_apis.py runs it on the pinned one)."""


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
    "EffectType",
    "assume_constant_result",
    "backward_writes_keep_versions",
    "compiler_config",
    "current_compile_id",
    "in_nested_region",
    "optimized_config",
    "skip_frames",
]
