"""Writing runs to object storage: real training written to ``s3://`` on a real S3-protocol
server on loopback (moto, s3_server.py), read back with pyarrow and TensorBoard's own reader;
kill -9 during training and at every object operation of finalization, then ``ti consolidate
s3://...``; a reader listing the prefix while the run writes; the requests a long run makes;
the three errors at attach.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from ti_core import (
    AlwaysSampler,
    TelemetryWarning,
    has_observer,
    inject_observer,
    observer_of,
    remove_observer,
)
from ti_io import ArtifactWriteError, DirectorySink, HistoryConfig
from ti_io.cli import main as ti
from ti_io.config import OBJECT_STORE_BUFFER_ROWS
from ti_io.finish.journal import Journal
from ti_io.storage import StorageError, resolve_location
from ti_schema import validate_history
from ti_trainers.attachment import Attachment

HERE = Path(__file__).parent
# ti-io's test helpers (the synthetic-run factory and the moto S3 server with its fixtures),
# loaded by path: tests/ is not a package and ti-io's tests folder is not on sys.path here.
IO_TESTS = HERE.parent / "packages" / "ti-io" / "tests"


def _load(name: str, folder: Path = IO_TESTS) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


_io_helpers = _load("_io_helpers")
s3_server = _load("s3_server")
Synth, make_run = _io_helpers.Synth, _io_helpers.make_run
S3Store, free_port = s3_server.S3Store, s3_server.free_port
moto, s3 = s3_server.moto, s3_server.s3  # the fixtures: a moto S3 server, a bucket on it
VALUES = ["sample_id", "layer", "signal", "metric", "value"]


# The killed runs' model and training step (object_store_kills.py), so both train the same.
_kills = _load("object_store_kills", HERE)
_model = _kills._model


def _train(model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        _kills._step(model, opt, step)


def _rows(s3: S3Store, *parts: str) -> int:
    return int(pq.read_metadata(s3.key(*parts), filesystem=s3.filesystem).num_rows)


def _values(table: pa.Table) -> list[tuple[object, ...]]:
    picked = table.select(VALUES)
    return sorted(zip(*(picked.column(n).to_pylist() for n in VALUES), strict=True), key=repr)


def test_training_run_on_s3_finalizes_and_reads_back(s3: S3Store, tmp_path: Path) -> None:
    """The same training observed locally and on S3: identical rows; every final object and
    every TensorBoard event file read back; nothing of the live layout is left."""
    local, remote = _model(), _model()
    inject_observer(local, output_dir=tmp_path / "local", sampler=AlwaysSampler())
    _train(local, 6)
    remove_observer(local)
    inject_observer(
        remote, output_dir=s3.uri("runs", "a"), sampler=AlwaysSampler(), error_policy="raise"
    )
    _train(remote, 6)
    remove_observer(remote)

    keys = s3.keys()
    assert not [k for k in keys if ".parts/" in k or k.endswith("finalization.json")], keys
    history = pq.read_table(s3.key("runs/a/history.parquet"), filesystem=s3.filesystem)
    validate_history(history)
    expected = pq.read_table(tmp_path / "local" / "history.parquet")
    assert history.num_rows == expected.num_rows > 0
    got, want = _values(history), _values(expected)
    assert [r[:4] for r in got] == [r[:4] for r in want]
    np.testing.assert_allclose(
        np.array([np.nan if r[4] is None else r[4] for r in got], dtype=np.float64),
        np.array([np.nan if r[4] is None else r[4] for r in want], dtype=np.float64),
        rtol=1e-6,
    )
    result = json.loads(s3.filesystem.open_input_stream(s3.key("runs/a/result.json")).read())
    assert {r["layer"] for r in result} == {
        r["layer"] for r in json.loads((tmp_path / "local" / "result.json").read_text())
    }
    index = s3.filesystem.open_input_stream(s3.key("runs/a/index.md")).read().decode()
    assert f'RUN = "{s3.uri("runs", "a")}"' in index

    # TensorBoard: a sequence of complete event files, read by its own loader.
    events = [k for k in keys if "/tensorboard/" in k]
    assert events
    assert all("tfevents" in k for k in events)
    logdir = tmp_path / "tb"
    logdir.mkdir()
    for key in events:
        (logdir / key.rsplit("/", 1)[1]).write_bytes(
            s3.filesystem.open_input_stream(s3.key(key)).read()
        )
    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0})
    acc.Reload()
    histograms = pq.read_table(s3.key("runs/a/histograms.parquet"), filesystem=s3.filesystem)
    drawable = sum(1 for n in histograms.column("num").to_pylist() if n)
    assert sum(len(acc.Histograms(tag)) for tag in acc.Tags()["histograms"]) == drawable > 0


def _run_kills(s3: S3Store, tmp_path: Path) -> dict[str, dict[str, object]]:
    out = tmp_path / "kills.json"
    subprocess.run(
        [sys.executable, str(HERE / "object_store_kills.py"), s3.uri("kills"), str(out)],
        env={**os.environ, **s3.environment},
        check=True,
        timeout=240,
    )
    loaded: dict[str, dict[str, object]] = json.loads(out.read_text())
    return loaded


def _published_rows(s3: S3Store, prefix: str) -> int:
    """The history rows a killed run had published: what its journal recorded once the final
    files were written, else the rows of its history parts."""
    key = prefix.removeprefix(f"s3://{s3.bucket}/")
    fs = s3.filesystem
    info = fs.get_file_info(s3.key(key, "finalization.json"))
    if info.type == pafs.FileType.File:
        journal = Journal.from_json(
            fs.open_input_stream(info.path).read().decode(), Path("finalization.json")
        )
        if journal.history_rows is not None:
            return journal.history_rows
    return sum(_rows(s3, k) for k in s3.keys(key, "history.parts") if k.endswith(".parquet"))


def test_kill_during_training_and_at_every_finalization_step(
    s3: S3Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL in the training loop and before each object operation of removal; `ti
    consolidate s3://...` then finishes every run with every published row (and the same rows
    as the uninterrupted run once all of its parts were published)."""
    results = _run_kills(s3, tmp_path)
    reference = results.pop("reference")
    trace = reference["trace"]
    assert isinstance(trace, list)
    assert any("finalization.json" in op for op in trace)
    total = _rows(s3, "kills/reference/history.parquet")
    want = _values(
        pq.read_table(s3.key("kills/reference/history.parquet"), filesystem=s3.filesystem)
    )
    last_part = max(i for i, op in enumerate(trace, 1) if "history.parts/part-" in op)
    assert len(results) == len(trace) + 1
    for case, result in results.items():
        assert result["killed"], case
        prefix = str(result["prefix"])
        published = _published_rows(s3, prefix)
        assert ti(["consolidate", prefix]) == 0, (case, capsys.readouterr().err)
        key = prefix.removeprefix(f"s3://{s3.bucket}/")
        leftover = [k for k in s3.keys(key) if ".parts/" in k or "finalization.json" in k]
        assert not leftover, (case, leftover)
        got = _rows(s3, key, "history.parquet")
        assert got == published, case
        kill_at = result["kill_at"]
        if isinstance(kill_at, int) and kill_at > last_part:
            assert got == total, case
            assert (
                _values(pq.read_table(s3.key(key, "history.parquet"), filesystem=s3.filesystem))
                == want
            )
    capsys.readouterr()
    assert ti(["consolidate", s3.uri("kills", "reference")]) == 0
    assert "already consolidated" in capsys.readouterr().out


def test_interrupted_multipart_upload_is_never_visible(s3: S3Store) -> None:
    """A process killed while uploading a large object (multipart) leaves nothing a listing
    or a read can see."""
    code = (
        "import sys\n"
        "from ti_io.storage import publish_bytes, resolve_location\n"
        "publish_bytes(resolve_location(sys.argv[1]), b'x' * (48 << 20))\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, s3.uri("big", "object.bin")],
        env={**os.environ, **s3.environment},
    )
    try:
        deadline = time.monotonic() + 60
        while not any("partNumber=" in r.query for r in s3.requests()):
            assert child.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert s3.keys("big") == []
    info = s3.filesystem.get_file_info(s3.key("big", "object.bin"))
    assert info.type == pafs.FileType.NotFound


def test_a_reader_listing_the_run_while_it_writes_never_sees_a_partial_object(
    s3: S3Store,
) -> None:
    """Every object listed while the run publishes parts every few milliseconds parses whole:
    Parquet parts and final files, TensorBoard event files, JSON."""
    run = make_run(focus=("encoder.0",))
    synth = Synth(run)
    sink = DirectorySink(
        s3.uri("live"), history_config=HistoryConfig(buffer_rows=40, flush_seconds=0.01)
    )
    sink.open(run)
    stop = threading.Event()
    seen: dict[str, int] = {}
    problems: list[str] = []

    def read_everything() -> None:
        fs = s3.filesystem
        while not stop.is_set():
            for key in s3.keys("live"):
                try:
                    data = fs.open_input_stream(s3.key(key)).read()
                except FileNotFoundError:
                    continue  # retired between the listing and the read
                try:
                    if key.endswith(".parquet"):
                        pq.read_table(pa.BufferReader(data))
                    elif key.endswith(".json"):
                        json.loads(data)
                    elif "tfevents" in key:
                        _check_records(data)
                except Exception as exc:
                    problems.append(f"{key}: {exc}")
                seen[key] = seen.get(key, 0) + 1

    reader = threading.Thread(target=read_everything)
    reader.start()
    try:
        for sample in range(40):
            sink.write_history(synth.history(sample))
            sink.write_histograms(synth.histograms(sample))
            time.sleep(0.005)
        sink.close()
    finally:
        stop.set()
        reader.join(timeout=60)
    assert not problems, problems[:3]
    parts = [k for k in seen if ".parts/part-" in k]
    assert len(parts) >= 5
    assert any("tfevents" in k for k in seen)


def _check_records(data: bytes) -> None:
    """Every record of a TensorBoard event file whole (length, CRCs checked by TensorBoard's
    own reader)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    at = 0
    while at < len(data):
        (length,) = np.frombuffer(data[at : at + 8], "<u8")
        assert masked_crc32c(data[at : at + 8]) == int(
            np.frombuffer(data[at + 8 : at + 12], "<u4")[0]
        )
        body = data[at + 12 : at + 12 + int(length)]
        crc = int(np.frombuffer(data[at + 12 + int(length) : at + 16 + int(length)], "<u4")[0])
        assert masked_crc32c(body) == crc
        at += 16 + int(length)


def test_request_count_of_a_long_dense_run_is_bounded(s3: S3Store) -> None:
    """1,000 densely sampled forwards of a 100-layer model (1.8 million history rows) with the
    object-store defaults: the writes are the parts the rows fill, their TensorBoard files and
    the fixed cost of open and finalization; `ti summary` adds none."""
    layers = tuple((f"blocks.{i}", "Linear") for i in range(100))
    run = make_run(layers, focus=tuple(name for name, _ in layers[:8]))
    synth = Synth(run)
    template = pa.Table.from_batches([synth.history(0)])
    histograms = pa.Table.from_batches([synth.histograms(0)])
    forwards = 1000
    sink = DirectorySink(s3.uri("long"))
    before = len(s3.requests())
    sink.open(run)
    for forward in range(forwards):
        ids = pa.array(np.full(template.num_rows, forward, dtype=np.int64))
        sink.write_history(
            template.set_column(
                template.schema.get_field_index("sample_id"), "sample_id", ids
            ).to_batches()[0]
        )
        hids = pa.array(np.full(histograms.num_rows, forward, dtype=np.int64))
        sink.write_histograms(
            histograms.set_column(
                histograms.schema.get_field_index("sample_id"), "sample_id", hids
            ).to_batches()[0]
        )
    sink.close()
    writes = [r for r in s3.requests()[before:] if r.is_write]
    rows = template.num_rows * forwards
    assert _rows(s3, "long", "history.parquet") == rows == 1_800_000
    history_parts = -(-rows // OBJECT_STORE_BUFFER_ROWS)
    histogram_parts = -(-histograms.num_rows * forwards // HistoryConfig().histogram_buffer_rows)
    publications = history_parts + histogram_parts
    # open: 3; each publication: a history part, a histogram part, an event file; finalization:
    # 2 journal PUTs, 5 final files, per parts prefix a batched delete and pyarrow's 2 marker
    # requests, the journal's DELETE and its marker.
    puts = 3 + 3 * publications + 2 + 5
    other = 3 * 3 + 2
    assert puts + other < 60
    # pyarrow before 19 has no delayed open: each of those PUTs is a 3-request multipart upload
    per_put = 1 if int(pa.__version__.split(".")[0]) >= 19 else 3
    bound = per_put * puts + other
    assert len(writes) <= bound, [(r.method, r.path) for r in writes]
    before = len(s3.requests())
    assert ti(["summary", s3.uri("long")]) == 0
    assert not [r for r in s3.requests()[before:] if r.is_write]


@pytest.fixture
def moto_auth() -> object:
    """moto checks credentials (it knows none) while the test runs."""
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin

    previous = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    ActionAuthenticatorMixin.request_count = 0
    yield
    settings.INITIAL_NO_AUTH_ACTION_COUNT = previous


def _attach_error(uri: str) -> StorageError:
    model = _model()
    with pytest.raises(StorageError) as caught:
        inject_observer(model, output_dir=uri, sampler=AlwaysSampler())
    assert not has_observer(model)
    _train(model, 1)  # the model trains on, unobserved
    return caught.value


def test_a_bucket_that_does_not_exist_fails_at_attach(s3: S3Store) -> None:
    error = _attach_error("s3://no-such-bucket-ti/run")
    assert "s3://no-such-bucket-ti/run" in str(error)
    assert "bucket does not exist" in str(error)


def test_a_uri_with_credentials_is_refused_at_attach_without_repeating_them() -> None:
    """``output_dir="s3://KEY:SECRET@bucket/run"``: refused before the model is touched, and
    neither the key nor the secret appears in the message."""
    from ti_io import CredentialsInURIError

    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzEXAMPLEKEY"
    model = _model()
    with pytest.raises(CredentialsInURIError) as caught:
        inject_observer(model, output_dir=f"s3://AKIAEXAMPLE:{secret}@bucket/run")
    assert not has_observer(model)
    text = str(caught.value)
    assert secret not in text
    assert "AKIAEXAMPLE" not in text
    assert "pass s3://bucket/run" in text
    _train(model, 1)


def test_wrong_credentials_fail_at_attach(s3: S3Store, moto_auth: object) -> None:
    error = _attach_error(s3.uri("run"))
    assert s3.uri("run") in str(error)
    assert "credentials were refused" in str(error)


def test_an_endpoint_that_refuses_connections_fails_at_attach(
    s3: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    error = _attach_error(s3.uri("run"))
    assert s3.uri("run") in str(error)
    assert "endpoint cannot be reached" in str(error)
    assert resolve_location(s3.uri("run")).local_path is None


def _outage_run(s3: S3Store, name: str, policy: str) -> tuple[nn.Module, int]:
    """Three forwards published as a part, then three more and the removal during an outage
    of the bucket (every write answered 503). Returns the model and the published rows."""
    net = _model()
    sink = DirectorySink(
        s3.uri(name), history_config=HistoryConfig(buffer_rows=10**6, flush_seconds=None)
    )
    inject_observer(net, sink=sink, sampler=AlwaysSampler(), error_policy=policy)  # type: ignore[arg-type]
    _train(net, 3)
    observer = observer_of(net)
    assert observer is not None
    observer.drain()
    sink.flush()
    published = sum(_rows(s3, k) for k in s3.keys(name, "history.parts") if "part-" in k)
    assert published > 0
    return net, published


def test_a_store_outage_mid_run_warns_and_keeps_every_published_row(
    s3: S3Store, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store refuses writes mid-run: training goes on, the default error policy warns with
    what was lost, and once the store is back `ti consolidate` finishes the run with every row
    that had been published."""
    net, published = _outage_run(s3, "outage", "warn")
    with s3.outage(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TelemetryWarning)
        _train(net, 3)  # the training loop never sees the store's errors
        remove_observer(net)
    assert not has_observer(net)
    assert len(s3.server.log.refused) > 0
    messages = " ".join(str(w.message) for w in caught if w.category is TelemetryWarning)
    assert "SERVICE_UNAVAILABLE" in messages, messages
    assert "162 history rows" in messages  # the three forwards of the outage, 54 rows each
    assert f"Everything already published in {s3.uri('outage')} stays readable" in messages
    assert f"`ti consolidate --force {s3.uri('outage')}`" in messages
    assert ti(["consolidate", "--force", s3.uri("outage")]) == 0, capsys.readouterr().err
    history = pq.read_table(s3.key("outage/history.parquet"), filesystem=s3.filesystem)
    validate_history(history)
    assert history.num_rows == published
    assert sorted(set(history.column("forward_index").to_pylist())) == [0, 1, 2]
    assert not [k for k in s3.keys("outage") if ".parts/" in k or "finalization.json" in k]


def test_revoked_credentials_under_error_policy_raise_raise_at_removal(s3: S3Store) -> None:
    """Writes refused mid-run (403: the credentials revoked) under error_policy="raise": removal
    raises what was lost after removing the hooks; every published row is kept."""
    net, published = _outage_run(s3, "outage-raise", "raise")
    with s3.outage("AccessDenied"):
        _train(net, 3)
        with pytest.raises(ArtifactWriteError, match="ACCESS_DENIED"):
            remove_observer(net)
    assert not has_observer(net)  # removed all the same: hooks gone, the error raised after
    assert ti(["consolidate", "--force", s3.uri("outage-raise")]) == 0
    assert _rows(s3, "outage-raise", "history.parquet") == published


def test_a_trainer_callback_writes_its_rank_to_the_object_store(
    s3: S3Store, tmp_path: Path
) -> None:
    """A trainer attachment given an s3:// output_dir reports the rank's URI (not a local path
    mangled from it) and the run lands there."""
    attachment = Attachment(
        {"output_dir": s3.uri("trainer"), "rank_policy": "all", "sampler": AlwaysSampler()}, "Cb"
    )
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    attachment.attach(net, default_dir=tmp_path / "default", rank=1, world_size=2)
    assert attachment.output_dir == s3.uri("trainer") + "/rank-001"
    for _ in range(3):
        net(torch.randn(5, 4)).sum().backward()
    attachment.detach()
    assert not (tmp_path / "default").exists()
    assert _rows(s3, "trainer/rank-001", "history.parquet") > 0
