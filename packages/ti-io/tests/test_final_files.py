"""The finalized Parquet files: how consolidation lays them out (docs/artifacts.md). Readers
rely on the contract footer, zstd with statistics for queries, dictionary-encoded strings, and
row groups gathered from whole parts; index.md says the run is finalized and counts it."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _fidelity import assert_final_files_match
from _io_helpers import Synth

from ti_io import DirectorySink, HistoryConfig
from ti_io.facts import RunFacts
from ti_io.finish.result_json import render
from ti_io.finish.statistics import finish_statistics
from ti_io.read.measurements import aggregate_files
from ti_io.read.row_groups import history_files
from ti_schema import histogram_schema, history_schema

# The module (``ti_io.finish.consolidate`` as an attribute is the package's function of that name).
CONSOLIDATE = importlib.import_module("ti_io.finish.consolidate")


def _finalized_run(
    directory: Path,
    s: Synth,
    samples: int,
    part_samples: int,
    before_close: Callable[[], None] = lambda: None,
) -> dict[str, list[pa.RecordBatch]]:
    # Parts of exactly ``part_samples`` samples: published by flush (the writer takes what is
    # buffered when it gets to it, so a part due by row count may hold a little more).
    config = HistoryConfig(buffer_rows=10**6, window=3, flush_seconds=None)
    sink = DirectorySink(directory, history_config=config)
    sink.open(s.run)
    sent: dict[str, list[pa.RecordBatch]] = {"history": [], "histograms": []}
    for sample in range(samples):
        sent["history"].append(s.history(sample))
        sent["histograms"].append(s.histograms(sample))
        sink.write_history(sent["history"][-1])
        sink.write_histograms(sent["histograms"][-1])
        if (sample + 1) % part_samples == 0:
            sink.flush()
    sink.flush()
    before_close()
    sink.close()
    return sent


@pytest.mark.parametrize("name", ["history.parquet", "histograms.parquet"])
def test_final_files_are_zstd_with_statistics_string_dictionaries_and_the_contract_footer(
    tmp_path: Path, synth: Callable[..., Synth], name: str
) -> None:
    s = synth()
    sent = _finalized_run(tmp_path, s, samples=6, part_samples=2)
    assert_final_files_match(tmp_path, sent)
    file = pq.ParquetFile(tmp_path / name)
    schema = file.schema_arrow
    footer = file.metadata.metadata
    assert b"ti" in footer  # the contract's footer (schema name, version, producer, window)
    # The Arrow schema a reader gets is the contract's: plain strings (not the dictionaries the
    # file was written from) and every field's documentation.
    contract = (history_schema if name == "history.parquet" else histogram_schema)("ti-io tests")
    assert schema.names == contract.names
    for got, want in zip(schema, contract, strict=True):
        assert got.type == want.type, got.name
        assert got.metadata == want.metadata, got.name
    strings = {f.name for f in schema if pa.types.is_string(f.type)}
    assert strings, "vacuous: the contract has string columns"
    checked = 0
    for g in range(file.metadata.num_row_groups):
        for c in range(file.metadata.num_columns):
            column = file.metadata.row_group(g).column(c)
            top = column.path_in_schema.split(".")[0]
            assert column.compression == "ZSTD", (name, top)
            assert column.is_stats_set, (name, top)
            dictionary = any("DICTIONARY" in e for e in column.encodings)
            assert dictionary == (top in strings), (name, top)
            checked += 1
    assert checked >= len(schema)


@pytest.mark.parametrize(
    ("group_parts", "extra", "expected"),
    [
        # a row group gathers whole parts until it holds ROW_GROUP_ROWS: 2 parts exactly
        (2, 0, (4, 4, 2)),
        # one row more: a third part is gathered (6 samples' rows), which the Parquet writer
        # splits at ROW_GROUP_ROWS; the remaining 2 parts make the last group
        (2, 1, (4, 2, 4)),
    ],
)
def test_row_groups_gather_whole_parts_up_to_row_group_rows(
    tmp_path: Path,
    synth: Callable[..., Synth],
    monkeypatch: pytest.MonkeyPatch,
    group_parts: int,
    extra: int,
    expected: tuple[int, ...],
) -> None:
    s = synth()
    per_sample = s.history(0).num_rows
    part_samples = 2
    threshold = group_parts * part_samples * per_sample + extra
    monkeypatch.setattr(CONSOLIDATE, "ROW_GROUP_ROWS", threshold)
    sent = _finalized_run(tmp_path, s, samples=10, part_samples=part_samples)  # 5 parts
    meta = pq.read_metadata(tmp_path / "history.parquet")
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    want = [n * per_sample for n in expected]
    if extra:  # the writer's split at the threshold moves `extra` rows into the first group
        want = [want[0] + extra, want[1] - extra, want[2]]
    assert sizes == want
    assert_final_files_match(tmp_path, sent)


def test_index_md_says_finalized_and_counts_the_histograms(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    sent = _finalized_run(tmp_path, s, samples=5, part_samples=2)
    text = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "**Status: finalized.**" in text
    assert "Status: live" not in text
    histogram_rows = sum(b.num_rows for b in sent["histograms"])
    assert histogram_rows > 0
    assert f"histograms:    {histogram_rows} rows" in text


@pytest.mark.parametrize("samples", [3, 7])  # observations == window (no previous), and more
def test_live_aggregation_of_ti_summary_reproduces_result_json(
    tmp_path: Path, synth: Callable[..., Synth], samples: int
) -> None:
    """What ``ti summary`` computes from a live run's parts (``aggregate_files``, reading the
    parts' row groups) and finalization's digest (fed the row groups it writes) are one
    aggregation fed two ways: the same history must render the same result.json, byte for
    byte (shapes, dtypes, module types and unavailable reasons included)."""
    s = synth(empty_every=2)  # unavailable values, with their reasons
    facts = RunFacts.from_run(s.run, 3)
    live: list[pl.DataFrame] = []

    def aggregate_live() -> None:
        files = history_files(tmp_path)
        assert not files.final
        assert len(files.paths) > 1, "vacuous: the parts were not read"
        live.append(aggregate_files(files, facts.window)[0])

    _finalized_run(tmp_path, s, samples=samples, part_samples=2, before_close=aggregate_live)
    aggregated = finish_statistics(live[0], facts.window)
    text = render(facts.layers, aggregated, window=facts.window, metrics=facts.metrics)
    written = (tmp_path / "result.json").read_text(encoding="utf-8")
    assert '"unavailable_reason": "' in written, "vacuous: no unavailable value was recorded"
    assert text == written


def test_result_json_lists_catalog_layers_in_catalog_order_then_the_rest_by_name(
    tmp_path: Path, synth: Callable[..., Synth]
) -> None:
    s = synth()
    _finalized_run(tmp_path, s, samples=2, part_samples=1)
    facts = RunFacts.from_run(s.run, 3)
    history = pl.scan_parquet(tmp_path / "history.parquet")
    files = history_files(tmp_path)
    aggregated = finish_statistics(aggregate_files(files, facts.window)[0], facts.window)
    names = [layer.name for layer in facts.layers]
    executed = sorted(set(history.select("layer").collect().to_series().to_list()))
    assert len(executed) >= 2, "vacuous: the order of one layer says nothing"

    def layers_of(text: str) -> list[str]:
        return [record["layer"] for record in json.loads(text)]

    backwards = list(reversed(facts.layers))
    text = render(backwards, aggregated, window=facts.window, metrics=facts.metrics)
    assert layers_of(text) == list(reversed(names))  # the catalog's order, not the names'
    # Without a catalog (an upgraded run, say) the layers the history names, by name.
    text = render([], aggregated, window=facts.window, metrics=facts.metrics)
    assert layers_of(text) == executed
