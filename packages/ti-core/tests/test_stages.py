"""Error-policy stage names are derived from the signal, and keep the words users have seen in
warnings since the first release."""

from __future__ import annotations

from ti_core.reduction.ended import EndedSignal
from ti_core.stages import stage_of
from ti_schema import SIGNALS


def test_every_signal_has_its_capture_and_emission_stage() -> None:
    assert {s: (stage_of(s, "capture"), stage_of(s, "emission")) for s in SIGNALS} == {
        "output": ("output capture", "forward emission"),
        "output_gradient": ("gradient capture", "gradient emission"),
        "parameter": ("parameter capture", "parameter emission"),
        "parameter_gradient": ("parameter gradient capture", "parameter gradient emission"),
        "parameter_update": ("parameter update capture", "parameter update emission"),
        "optimizer_state": ("optimizer state capture", "optimizer state emission"),
        "attention": ("attention capture", "attention emission"),
        "input": ("input capture", "input emission"),
    }


def test_a_new_signal_needs_no_stage_of_its_own() -> None:
    assert stage_of("residual", "capture") == "residual capture"
    assert stage_of("activation_norm", "emission") == "activation norm emission"


def test_an_ended_signal_names_its_stage_and_its_gap_rows() -> None:
    batch = object()  # never reduced here
    ended = EndedSignal("parameter_update", 0, 3, batch)  # type: ignore[arg-type]
    assert ended.stage == "parameter update emission"
    assert ended.gaps_signal == "parameter_update"
    output = EndedSignal("output", 0, 3, batch, gap_signal="output_gradient")  # type: ignore[arg-type]
    assert (output.stage, output.gaps_signal) == ("forward emission", "output_gradient")
