"""The caller's own run settings (``inject_observer(settings=...)``) and the pipeline stage
observer's argument checks (the stages themselves: tests/test_dist_parallelism.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ti_core import (
    AlwaysSampler,
    MemorySink,
    has_observer,
    inject_observer,
    inject_stage_observer,
    observer_of,
    remove_observer,
)


def test_settings_are_recorded_beside_ti_cores() -> None:
    """The sinks get them with the run (ti-io writes them to run.json and index.md: the
    pipeline tests read them back, tests/test_dist_parallelism.py)."""
    model = nn.Sequential(nn.Linear(3, 2))
    sink = MemorySink()
    inject_observer(
        model,
        output_dir=None,
        sink=sink,
        sampler=AlwaysSampler(),
        settings={"experiment": "lr-3e-4"},
    )
    observer = observer_of(model)
    assert observer is not None
    assert observer.run.settings["experiment"] == "lr-3e-4"
    assert observer.run.settings["signals"] == "output,output_gradient"
    model(torch.randn(4, 3)).sum().backward()
    remove_observer(model)
    assert sink.run is not None
    assert sink.run.settings["experiment"] == "lr-3e-4"


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"signals": "output"}, ValueError, r"may not set \['signals'\]: ti-core records them"),
        ({"tag": 3}, TypeError, "settings= must map non-empty strings to strings"),
        ({"": "x"}, TypeError, "settings= must map non-empty strings to strings"),
        (["tag"], TypeError, "settings= must map"),
    ],
)
def test_bad_settings_are_refused_before_anything_attaches(
    settings: object, error: type[Exception], match: str
) -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(error, match=match):
        inject_observer(model, output_dir=None, sink=MemorySink(), settings=settings)  # type: ignore[arg-type]
    assert not has_observer(model)


def test_a_stage_observer_needs_a_stage_and_its_microbatch_count() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"stage must be a torch\.distributed\.pipelining"):
        inject_stage_observer(model, microbatches=4, output_dir=None, sink=MemorySink())
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="microbatches= must be the schedule's"):
            inject_stage_observer(model, microbatches=bad, output_dir=None)  # type: ignore[arg-type]
    assert not has_observer(model)
