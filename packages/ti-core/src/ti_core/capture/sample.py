"""One sampled root forward and the recording of each selected module call during it.

Ownership: a :class:`Sample` is created by the gate when a sampled root forward starts, lives in
the thread-local state of the thread running that forward, and is handed to the observer when
the root forward returns. Only its gradient state (:mod:`ti_core.capture.gradients`) outlives
it, on the autograd graph.
"""

from __future__ import annotations

import weakref
from typing import Any, Final

import torch
from torch import nn

from ti_core.capture.batch import TensorBatch
from ti_core.capture.context import in_reentrant_checkpoint, now_us
from ti_core.capture.gradients import GradientState, GradientTarget
from ti_core.capture.parameters import ParameterSample
from ti_core.capture.paths import tensor_leaves
from ti_core.records import Entry
from ti_core.reduction.support import dtype_name

LEAF_REASON: Final[str] = (
    "gradient not captured: the output is a leaf tensor (the module returned an input or "
    "parameter unchanged)"
)
REENTRANT_REASON: Final[str] = (
    "gradient not captured: reentrant activation checkpoint "
    "(use torch.utils.checkpoint(..., use_reentrant=False))"
)


class Sample:
    """One sampled root forward: its outputs, its coverage gaps and its gradient state, and the
    parameter side when the parameter signals are on.

    ``outputs`` / ``output_gradients`` say whether the ``output`` and ``output_gradient``
    signals are recorded (``inject_observer(signals=)``).
    """

    __slots__ = (
        "calls",
        "forward",
        "forward_index",
        "gaps",
        "gradients",
        "output_gradients",
        "outputs",
        "parameters",
        "sample_id",
        "target",
    )

    def __init__(
        self,
        sample_id: int,
        forward_index: int,
        batch: TensorBatch,
        target: weakref.ref[GradientTarget],
        *,
        outputs: bool = True,
        output_gradients: bool = True,
        parameters: ParameterSample | None = None,
    ) -> None:
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.target = target
        """Where this sample's gradients go (held weakly, as by the gradient state)."""
        self.calls: dict[int, int] = {}
        self.forward = batch
        """The outputs recorded so far."""
        self.gaps: list[tuple[Entry, str]] = []
        """Outputs whose gradient cannot be captured, with the reason."""
        self.gradients: GradientState | None = None
        self.outputs = outputs
        self.output_gradients = output_gradients
        self.parameters = parameters
        """The parameter signals of this forward (None when they are off)."""

    def record(self, layer: int, module: nn.Module, output: Any) -> None:
        """One call of the selected module ``layer`` returned ``output``: snapshot each tensor
        and, where a gradient will flow back into it, hook that gradient."""
        call = self.calls.get(layer, 0)
        self.calls[layer] = call + 1
        leaves = tensor_leaves(output)
        if self.parameters is not None:
            self.parameters.record_call(layer, module, leaves)
        if not leaves or not (self.outputs or self.output_gradients):
            return
        stamp = now_us()
        train = bool(module.training)
        grad_enabled = torch.is_grad_enabled()
        reentrant: bool | None = None
        for path, tensor in leaves:
            entry = Entry(
                layer,
                call,
                path,
                train,
                grad_enabled,
                tuple(tensor.shape),
                dtype_name(tensor.dtype),
                stamp,
            )
            if self.outputs:
                self.forward.add(entry, tensor)
            if not self.output_gradients:
                continue
            if grad_enabled and tensor.requires_grad:
                if tensor.grad_fn is None:
                    self.gaps.append((entry, LEAF_REASON))
                else:
                    if self.gradients is None:
                        self.gradients = GradientState(
                            self.target, self.sample_id, self.forward_index
                        )
                    self.gradients.watch(entry, tensor)
            elif not grad_enabled and (tensor.is_floating_point() or tensor.is_complex()):
                if reentrant is None:
                    reentrant = in_reentrant_checkpoint()
                if reentrant:
                    self.gaps.append((entry, REENTRANT_REASON))

    def forward_done(self) -> None:
        """The root forward returned: no more gradient hooks will be registered."""
        if self.gradients is not None:
            self.gradients.forward_done()


__all__ = ["LEAF_REASON", "REENTRANT_REASON", "Sample"]
