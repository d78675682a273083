"""Outputs that are not plain tensors (docs/capture.md, "Tensor subclasses"): nested (jagged)
tensors and subclasses that keep their entries in their own storage are measured exactly
through their plain entries; a wrapper subclass (``__torch_dispatch__``) without one gets a
reason naming its type, never a generic exception. DTensors: tests/test_dist_tensor_parallel.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from _core_helpers import assert_matches, reference, stats
from torch import nn
from torch.utils._pytree import tree_map

from ti_core import AlwaysSampler, MemorySink, TelemetryWarning, observe
from ti_schema import DEFAULT_METRICS
from ti_schema.testing import assert_history_conforms


class Tagged(torch.Tensor):
    """A subclass with no dispatch of its own: its entries are its storage's."""


class Wrapper(torch.Tensor):
    """A wrapper subclass (as float8 training tensors are): its entries live in ``inner``, an
    arbitrary encoding ti-core cannot know."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, requires_grad=inner.requires_grad
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = tree_map(lambda t: t.inner if isinstance(t, Wrapper) else t, args)
        out = func(*unwrap, **(kwargs or {}))
        return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)


class PassThrough(Wrapper):
    """A traceable wrapper holding one plain tensor of its shape and dtype (as torchao's
    float8 training weights do): its entries are that tensor's."""

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any
    ) -> PassThrough:
        return PassThrough(inner["inner"])


class Scaled(Wrapper):
    """A traceable wrapper whose entries are an encoding: data and a scale."""

    def __init__(self, inner: torch.Tensor) -> None:
        super().__init__(inner)
        self.scale = torch.ones(())

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["inner", "scale"], None


class Outputs(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        lengths = [3, 1, 4]
        rows = torch.split(x[: sum(lengths)] * 2, lengths)
        return {
            "jagged": torch.nested.nested_tensor(list(rows), layout=torch.jagged),
            "tagged": (x * 3).as_subclass(Tagged),
            "wrapped": Wrapper(x * 4),
            "passed": PassThrough(x * 5),
            "scaled": Scaled(x * 6),
        }


def test_subclass_outputs_are_measured_exactly_or_named() -> None:
    x = torch.randn(8, 5)
    model = nn.Sequential(Outputs())
    sink = MemorySink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TelemetryWarning)  # no reduction failure anywhere
        with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
            model(x)
    table = sink.table()
    assert_history_conforms(table)
    jagged = stats(table, signal="output", tensor_path="['jagged']")
    assert_matches(jagged, reference((x[:8] * 2).numpy()))
    assert_matches(
        stats(table, signal="output", tensor_path="['tagged']"), reference((x * 3).numpy())
    )
    wrapped = [
        r
        for r in table.to_pylist()
        if r["tensor_path"] == "['wrapped']" and r["signal"] == "output"
    ]
    assert {r["metric"] for r in wrapped} == set(DEFAULT_METRICS)
    assert all(r["value"] is None for r in wrapped)
    assert {r["unavailable_reason"] for r in wrapped} == {
        f"a tensor subclass ({__name__}.Wrapper) without a plain representation: not measured"
    }
    assert wrapped[0]["shape"] == [8, 5]
    passed = stats(table, signal="output", tensor_path="['passed']")
    assert_matches(passed, reference((x * 5).numpy()))
    scaled = [
        r for r in table.to_pylist() if r["tensor_path"] == "['scaled']" and r["signal"] == "output"
    ]
    assert {r["unavailable_reason"] for r in scaled} == {
        f"a tensor subclass ({__name__}.Scaled) without a plain representation: not measured"
    }


def test_jagged_output_gradients_are_measured_exactly() -> None:
    """The gradient of a nested output is itself nested: measured through its entries."""
    lengths = [2, 5, 1]
    x = torch.randn(sum(lengths), 4, requires_grad=True)

    class Jagged(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return torch.nested.nested_tensor_from_jagged(t * 1.5, lengths=torch.tensor(lengths))

    model = nn.Sequential(Jagged())
    sink = MemorySink()
    weights = torch.randn(sum(lengths), 4)
    with observe(model, output_dir=None, sink=sink, sampler=AlwaysSampler()):
        out = model(x)
        (out.values() * weights).sum().backward()
    table = sink.table()
    assert_history_conforms(table)
    assert_matches(stats(table, signal="output"), reference((x.detach() * 1.5).numpy()))
    assert_matches(stats(table, signal="output_gradient"), reference(np.asarray(weights.numpy())))
