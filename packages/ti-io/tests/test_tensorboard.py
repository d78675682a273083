"""TensorBoard: tags for arbitrary names and our event files (caller-owned writers, which need
torch, are tested in tests/test_io_tensorboard_writers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote

import pytest
from _io_helpers import Synth, make_run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ti_io import DirectorySink, TensorBoardSink, histogram_tag
from ti_io.write.tags import ROOT_TAG, escape_tag_part


def _load(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    return acc


@pytest.mark.parametrize(
    "name",
    ["blocks.0", "a/b", "..", "x\ny", "<script>alert(1)</script>", "`code` | *x*", "名前", "50%"],
)
def test_tags_escape_names_reversibly(name: str) -> None:
    tag = histogram_tag(name, 2, "output", "['a/b']")
    layer, call, rest = tag.split("/")
    assert unquote(layer) == name
    assert call == "call2"
    assert unquote(rest) == "output['a/b']"
    assert all(c.isprintable() and not c.isspace() for c in tag)
    assert not set(tag) & set("<>&\"'`\\")


@pytest.mark.parametrize(
    ("signal", "path", "tag"),
    [
        ("parameter", "weight", "fc/call0/parameter.weight"),
        ("parameter_update", "in_proj_weight", "fc/call0/parameter_update.in_proj_weight"),
        ("parameter_gradient", "weight@S(0)", "fc/call0/parameter_gradient.weight@S(0)"),
        ("output", "[0]", "fc/call0/output[0]"),
        ("output_gradient", ".hidden", "fc/call0/output_gradient.hidden"),
        ("output", "", "fc/call0/output"),
    ],
)
def test_a_parameter_name_is_joined_with_a_dot(signal: str, path: str, tag: str) -> None:
    """Output paths are accessors that start with [ or . already; a parameter's name is not,
    so the tag joins it with a dot (still two slashes: TensorBoard groups by layer)."""
    assert histogram_tag("fc", 0, signal, path) == tag
    weird = histogram_tag("fc", 0, "parameter", "w/eight")
    assert weird == "fc/call0/parameter.w%2Feight"


def test_root_tag_cannot_collide() -> None:
    assert histogram_tag("", 0, "output", "") == f"{ROOT_TAG}/call0/output"
    assert escape_tag_part(ROOT_TAG) != ROOT_TAG  # a module named "%root" is escaped


def test_directory_events_hold_exactly_the_focus_histograms(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    layers = (("enc", "Linear"), ("odd/name\n", "ReLU"), ("head", "Linear"))
    run = make_run(layers, focus=("enc", "odd/name\n"))
    s = Synth(run)
    sink = DirectorySink(tmp_path)
    sink.open(run)
    batches = [s.histograms(i) for i in range(4)]
    for i, batch in enumerate(batches):
        sink.write_history(s.history(i))
        sink.write_histograms(batch)
    sink.close()
    acc = _load(tmp_path / "tensorboard")
    expected = {
        histogram_tag(layer, 0, signal, "")
        for layer in ("enc", "odd/name\n")
        for signal in ("output", "output_gradient")
    }
    assert set(acc.Tags()["histograms"]) == expected
    first = batches[0].to_pylist()[0]
    events = acc.Histograms(histogram_tag("enc", 0, "output", ""))
    assert [e.step for e in events] == [0, 1, 2, 3]
    assert events[0].histogram_value.min == first["min"]
    assert events[0].histogram_value.num == first["num"]
    assert list(events[0].histogram_value.bucket) == first["bucket_counts"]


def test_tensorboard_sink_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match="SummaryWriter"):
        TensorBoardSink(object())


def test_record_framing_is_tensorboards_byte_for_byte(tmp_path: Path) -> None:
    """Our framing (C CRC-32C) against TensorBoard's own ``RecordWriter`` (pure-Python CRC):
    the same bytes for the same records, so TensorBoard's reader, which checks both CRCs of
    every record, reads our event files."""
    import io
    import random

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
        masked_crc32c as tensorboard_crc,
    )
    from tensorboard.summary.writer.record_writer import RecordWriter

    from ti_io.write.tensorboard_sink import RecordFile, masked_crc32c

    rng = random.Random(7)
    records = [
        b"",
        b"\x00",
        b"\xff" * 3,
        *(rng.randbytes(rng.randrange(1, 3000)) for _ in range(40)),
    ]
    for data in records:
        assert masked_crc32c(data) == tensorboard_crc(data), len(data)
    ours, theirs = io.BytesIO(), io.BytesIO()
    mine, reference = RecordFile(ours), RecordWriter(theirs)
    for data in records:
        mine.write(data)
        reference.write(data)
    mine.flush()
    reference.flush()
    assert ours.getvalue() == theirs.getvalue()
    assert len(ours.getvalue()) == sum(len(d) + 16 for d in records)
