"""The producer/sink contract types: declared capabilities, rank selections, no torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from ti_schema import (
    DeclaresCapabilities,
    RankPolicy,
    RankSelection,
    Sink,
    SinkCapabilities,
    sink_capabilities,
)
from ti_schema.testing import example_history_table, example_run_info


class PlainSink:
    def open(self, run: Any) -> None:
        pass

    def write_history(self, batch: Any) -> None:
        pass

    def write_histograms(self, batch: Any) -> None:
        pass

    def close(self) -> None:
        pass


class DeclaringSink(PlainSink):
    def __init__(self, declared: Any) -> None:
        self.declared = declared
        self.barriers: list[Any] = []

    def capabilities(self) -> Any:
        return self.declared


def test_a_sink_without_a_declaration_gets_the_defaults() -> None:
    sink = PlainSink()
    assert isinstance(sink, Sink)
    assert not isinstance(sink, DeclaresCapabilities)
    assert sink_capabilities(sink) == SinkCapabilities()
    assert sink_capabilities(sink).background_writes is False
    assert sink_capabilities(sink).on_barrier is None
    assert sink_capabilities(sink).flush is None


def test_a_declared_barrier_hook_is_returned_as_declared() -> None:
    sink = DeclaringSink(None)
    sink.declared = SinkCapabilities(background_writes=True, on_barrier=sink.barriers.append)
    assert isinstance(sink, DeclaresCapabilities)
    declared = sink_capabilities(sink)
    assert declared.background_writes
    assert declared.on_barrier is not None

    def barrier() -> None:
        pass

    declared.on_barrier(barrier)
    assert sink.barriers == [barrier]


@pytest.mark.parametrize("declared", [None, {"background_writes": True}, True])
def test_a_declaration_of_the_wrong_type_is_refused(declared: Any) -> None:
    with pytest.raises(TypeError, match=r"capabilities\(\) must return a ti_schema"):
        sink_capabilities(DeclaringSink(declared))


def test_capabilities_must_be_a_method() -> None:
    class AttributeSink(PlainSink):
        capabilities = SinkCapabilities(background_writes=True)

    with pytest.raises(TypeError, match="must be a method returning"):
        sink_capabilities(AttributeSink())


def test_capabilities_check_their_fields() -> None:
    with pytest.raises(TypeError, match=r"background_writes=.*True or False"):
        SinkCapabilities(background_writes="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"on_barrier=.*callable"):
        SinkCapabilities(on_barrier=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"flush=.*callable taking no arguments"):
        SinkCapabilities(flush="now")  # type: ignore[arg-type]


def test_rank_policy_protocol_and_selection() -> None:
    class Fixed:
        def select(self) -> RankSelection:
            return RankSelection(rank=1, world_size=2, observe=True, subdir="rank-001")

    assert isinstance(Fixed(), RankPolicy)
    assert Fixed().select() == RankSelection(1, 2, True, "rank-001")
    assert RankSelection(0, 1, True).subdir is None


def test_example_run_info_describes_the_example_tables() -> None:
    run = example_run_info()
    table = example_history_table(54)
    assert [layer.name for layer in run.layers] == sorted(set(table["layer"].to_pylist()))
    assert run.focus_layers == tuple(layer.name for layer in run.layers)
    assert run.metrics == tuple(table["metric"].to_pylist()[:9])
    assert set(table["run_id"].to_pylist()) == {run.run_id}
    assert example_run_info(rank=3, rank_subdir="rank-003").world_size == 4


def test_the_contract_imports_without_torch_or_polars() -> None:
    # In ti-schema's own environment they are not installed at all; elsewhere they must not be
    # imported by it.
    code = (
        "import sys, ti_schema, ti_schema.testing, ti_schema.layout, ti_schema.artifacts; "
        "print(sorted(m for m in ('torch', 'polars', 'tensorboard') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
