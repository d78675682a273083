"""Reading runs on object storage: ``ti summary``, ``ti validate``, ``ti compare``,
``scan_history`` and Polars on ``s3://`` against a real S3-protocol server on loopback (moto,
s3_server.py).

The runs are written on local disk by the directory sink and uploaded object by object; each
remote read is checked against the same read of the local run. Readers never write to the
store (the server's own request log), list a run with one list call, verify page checksums
as for local files, and say in one line which URI they could not read.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import polars as pl
import pytest
from _io_helpers import Synth, make_run
from s3_server import S3Store, free_port

from ti_io import DamagedFileError, DirectorySink, HistoryConfig, scan_history, validate_run
from ti_io.cli import main
from ti_io.storage import StorageError
from ti_schema import DEFAULT_METRICS

_SPEC = importlib.util.spec_from_file_location(
    "run_damage", Path(__file__).parents[3] / "tests" / "run_damage.py"
)
assert _SPEC is not None
assert _SPEC.loader is not None
run_damage = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run_damage)

LAYERS = (("encoder.0", "Linear"), ("encoder.1", "ReLU"), ("", "Net"))
SAMPLES = 6


def _write(out: Path, s: Synth, *, finalize: bool) -> None:
    """A run of SAMPLES samples: closed (finalized) or 'died' after publishing its parts."""
    sink = DirectorySink(out, history_config=HistoryConfig(buffer_rows=30, window=2))
    sink.open(s.run)
    for i in range(SAMPLES):
        sink.write_history(s.history(i))
        sink.write_histograms(s.histograms(i))
    if finalize:
        sink.close()
    else:
        sink._flush_at_exit()  # what the interpreter-exit hook does: parts, no finalization


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def runs(tmp_path: Path, s3: S3Store) -> dict[str, tuple[Path, str]]:
    """A finalized and a live run, each on disk and uploaded: name -> (path, URI)."""
    made = {}
    for name, finalize, seed in (("finalized", True, 0), ("live", False, 1)):
        local = tmp_path / name
        _write(local, Synth(make_run(LAYERS), seed=seed), finalize=finalize)
        made[name] = (local, s3.upload(local, "jobs", name))
    return made


def _sorted(frame: pl.LazyFrame) -> pl.DataFrame:
    keys = ["sample_id", "layer", "signal", "metric"]
    return frame.collect().sort(keys)


def test_summary_validate_and_scan_read_the_store_as_the_disk(
    runs: dict[str, tuple[Path, str]], s3: S3Store, capsys: pytest.CaptureFixture[str]
) -> None:
    for local, uri in runs.values():
        before = len(s3.requests())
        code, out, err = _cli(capsys, "summary", uri)
        assert (code, err) == (0, "")
        summary_requests = s3.requests()[before:]
        local_code, local_out, _ = _cli(capsys, "summary", str(local))
        assert local_code == 0
        assert out == local_out.replace(str(local), uri)  # the same table, named by the URI
        assert uri in out.splitlines()[0]
        # ti summary reads: no write of any kind, and the whole run from one listing
        assert [r for r in summary_requests if r.is_write] == []
        assert len([r for r in summary_requests if r.is_list]) == 1

        assert _cli(capsys, "validate", uri) == (0, "ok\n", "")
        remote = scan_history(uri)
        expected = _sorted(scan_history(local))
        assert _sorted(remote).equals(expected)
        assert expected.height == SAMPLES * 2 * len(LAYERS) * len(DEFAULT_METRICS)
        # a query reads only what it needs, the filter applied by Polars
        layer = remote.filter(pl.col("layer") == "encoder.0").select("value").collect()
        assert layer.height == SAMPLES * 2 * len(DEFAULT_METRICS)

    finalized, live = (uri for _, uri in runs.values())
    code, out, _ = _cli(capsys, "compare", finalized, live)
    assert code == 0
    assert finalized in out
    assert "/tmp" not in out  # no local copy's path leaks into what ti prints


def test_report_reads_the_store_and_names_the_uris(
    runs: dict[str, tuple[Path, str]],
    s3: S3Store,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    finalized, live = (uri for _, uri in runs.values())
    before = len(s3.requests())
    out = tmp_path / "report.html"
    code, stdout, stderr = _cli(capsys, "report", finalized, live, "-o", str(out))
    assert (code, stderr) == (0, "")
    assert str(out) in stdout
    assert [r for r in s3.requests()[before:] if r.is_write] == []
    page = out.read_text(encoding="utf-8")
    for uri in (finalized, live):
        assert uri in page  # each run's location is its URI
    assert str(Path(tempfile.gettempdir())) not in page  # no local copy's path
    for layer in LAYERS:
        assert layer[0] in page


def test_a_flipped_bit_in_an_uploaded_part_is_named_by_its_uri(
    runs: dict[str, tuple[Path, str]], s3: S3Store, capsys: pytest.CaptureFixture[str]
) -> None:
    local, uri = runs["live"]
    part = sorted((local / "history.parts").glob("part-*.parquet"))[0]
    run_damage.flip_value_bit(part)
    relative = part.relative_to(local).as_posix()
    with s3.filesystem.open_output_stream(s3.key("jobs", "live", relative)) as out:
        out.write(part.read_bytes())
    damaged = f"{uri}/{relative}"

    code, out, _ = _cli(capsys, "validate", uri)
    assert code == 1
    assert f"{damaged}: damaged: a page fails its checksum" in out
    found = validate_run(uri)
    assert found.directory == uri
    assert [p.split(": damaged")[0] for p in found.problems] == [damaged]
    with pytest.raises(DamagedFileError, match="fails its checksum") as caught:
        scan_history(uri)
    assert caught.value.path == damaged
    code, _, err = _cli(capsys, "summary", uri)
    assert code == 1
    assert damaged in err


def test_polars_reads_the_run_directly_with_storage_options(
    runs: dict[str, tuple[Path, str]], s3: S3Store
) -> None:
    """What docs/reading-with-polars.md shows: Polars' own object-store client, its options
    naming the endpoint and credentials (no page checksums: ti validate first)."""
    local, uri = runs["finalized"]
    options = {
        "aws_endpoint_url": s3.endpoint,
        "aws_allow_http": "true",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "aws_region": "us-east-1",
    }
    frame = pl.scan_parquet(f"{uri}/history.parquet", storage_options=options)
    assert _sorted(frame).equals(_sorted(pl.scan_parquet(local / "history.parquet")))
    parts = pl.scan_parquet(f"{runs['live'][1]}/history.parts/*.parquet", storage_options=options)
    assert _sorted(parts).equals(_sorted(scan_history(runs["live"][0])))


def test_what_cannot_be_read_is_one_line_naming_the_uri(
    s3: S3Store, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing_bucket = "s3://no-such-bucket-ti/run"
    code, out, err = _cli(capsys, "summary", missing_bucket)
    assert (code, out) == (1, "")
    assert err == (
        f"ti summary: {missing_bucket}: listing the run failed: the bucket "
        "'no-such-bucket-ti' does not exist: check the bucket name in the URI\n"
    )
    with pytest.raises(StorageError, match=f"{missing_bucket}: listing the run failed"):
        scan_history(missing_bucket)

    empty = s3.uri("nothing", "here")
    code, _, err = _cli(capsys, "validate", empty)
    assert code == 1
    assert err == (
        f"ti validate: {empty}: no run there (nothing is stored under this prefix); "
        "pass a run's output_dir\n"
    )

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    code, _, err = _cli(capsys, "summary", s3.uri("run"))
    assert code == 1
    assert err.startswith(
        f"ti summary: {s3.uri('run')}: listing the run failed: the endpoint cannot be reached"
    )
    assert len(err.splitlines()) == 1


def test_a_local_copy_leaves_nothing_behind(
    runs: dict[str, tuple[Path, str]],
    capsys: pytest.CaptureFixture[str],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scratch = tmp_path_factory.mktemp("scratch")
    monkeypatch.setenv("TMPDIR", str(scratch))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert _cli(capsys, "validate", runs["finalized"][1])[0] == 0
    assert list(scratch.iterdir()) == []


def test_upgrade_reads_a_0_8_0_run_from_the_store_and_publishes_the_new_one_there(
    tmp_path: Path, s3: S3Store, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_legacy_runs import write_legacy_run

    old = tmp_path / "old"
    write_legacy_run(old, samples=5)
    old_uri = s3.upload(old, "legacy", "old")
    new_uri = s3.uri("legacy", "new")
    before = len(s3.requests())
    code, out, err = _cli(capsys, "upgrade", "--no-progress", old_uri, new_uri)
    assert (code, err) == (0, "")
    assert out.startswith(f"{new_uri}: upgraded the torchinstruments 0.8.0 run {old_uri} ")
    puts = [r.path for r in s3.requests()[before:] if r.method == "PUT"]
    assert len(puts) == len(s3.keys("legacy", "new"))  # one PUT per object, none rewritten
    assert puts[-1] == f"/{s3.key('legacy', 'new', 'history.parquet')}"  # published last
    assert [r for r in s3.requests()[before:] if r.is_write and "/old/" in r.path] == []
    assert _cli(capsys, "validate", new_uri) == (0, "ok\n", "")
    _cli(capsys, "upgrade", "--no-progress", str(old), str(tmp_path / "new"))
    assert _sorted(scan_history(new_uri)).equals(_sorted(scan_history(tmp_path / "new")))
    code, _, err = _cli(capsys, "upgrade", "--no-progress", old_uri, new_uri)  # occupied
    assert code == 1
    assert f"{new_uri} already holds objects" in err


SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzEXAMPLEKEY"


@pytest.mark.parametrize(
    "argv",
    [
        ("summary", "{uri}"),
        ("validate", "{uri}"),
        ("compare", "{uri}", "{uri}2"),
        ("consolidate", "{uri}"),
        ("upgrade", "{uri}", "{uri}-new"),
    ],
)
def test_a_uri_with_credentials_is_refused_without_repeating_them(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    """``s3://KEY:SECRET@bucket/run`` (a form pyarrow accepts): one line saying what to do
    instead, naming the run without the key or the secret; nothing is contacted."""
    uri = f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix/run"
    code, out, err = _cli(capsys, *(part.format(uri=uri) for part in argv))
    assert code != 0
    assert SECRET not in out + err
    assert "AKIAEXAMPLE" not in out + err
    assert "s3://***@bucket/prefix/run: the URI holds credentials" in err
    assert "pass s3://bucket/prefix/run" in err
    assert len(err.strip().splitlines()) == 1


def test_resolve_location_refuses_credentials_of_any_scheme() -> None:
    from ti_io import CredentialsInURIError, resolve_location

    for uri in (f"s3://key:{SECRET}@b/r", f"gs://user:{SECRET}@b/r?x=1", f"s3://{SECRET}@b"):
        with pytest.raises(CredentialsInURIError) as caught:
            resolve_location(uri)
        assert SECRET not in str(caught.value)
        assert caught.value.__cause__ is None
        assert caught.value.__context__ is None
    assert resolve_location("s3://bucket/run@2026-12-06", None).path == "bucket/run@2026-12-06"
