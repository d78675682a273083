"""What capture in compiled graphs refuses, checked at ``inject_observer`` before anything is
touched (a module compiled after it was observed is checked when it is first traced:
:func:`ti_core.compiled.traced.cuda_graphs_requested`)."""

from __future__ import annotations

from torch import nn

from ti_core._torch import optimized_config
from ti_core.compiled.traced import CUDA_GRAPHS_REFUSED, cuda_graphs_requested
from ti_core.selection import compiled_wrappers


def check_compiled_model(model: nn.Module) -> None:
    """Raise ValueError when ``model`` is (or wraps) a ``torch.compile``d module compiled for
    CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``)."""
    for wrapper in compiled_wrappers(model):
        if cuda_graphs_requested(optimized_config(wrapper)):
            raise ValueError(f"model is compiled for CUDA graphs; {CUDA_GRAPHS_REFUSED}")


__all__ = ["check_compiled_model"]
